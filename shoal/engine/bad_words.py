"""SamplingParams.bad_words -> the token id sequences the sampler bans (vLLM's
`update_from_tokenizer`): each word is tokenized as the text's start and after a space, the
second only when it differs from the first in its first token and has as many tokens (a
word that splits differently after a space is a different word to the model)."""

from __future__ import annotations

import dataclasses
from typing import Any

from shoal.engine.request_checks import check_text
from shoal.sampling_params import SamplingParams


def word_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """The token id sequences of `words` (see the module docstring), in order."""
    out: list[list[int]] = []
    for word in words:
        check_text(word, "bad_words")
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if plain:
            out.append(list(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(list(spaced))
    return out


def with_bad_words(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """params with bad_words' sequences added to bad_words_token_ids (params itself when it
    has no bad_words)."""
    if not params.bad_words:
        return params
    if tokenizer is None:
        raise ValueError("bad_words needs a tokenizer (this server runs with "
                         "--skip-tokenizer-init): give bad_words_token_ids instead")
    seqs = [*(params.bad_words_token_ids or []), *word_token_ids(tokenizer, params.bad_words)]
    return dataclasses.replace(params, bad_words=None, bad_words_token_ids=seqs or None)
