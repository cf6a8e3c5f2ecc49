"""thinking_token_budget's markers: the ids of <think> and </think> in the request's tokenizer,
found once per tokenizer and put into the request's SamplingParams (the engine core sees
token ids only)."""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from shoal.sampling_params import SamplingParams

_IDS: weakref.WeakKeyDictionary[Any, dict[str, int | None]] = weakref.WeakKeyDictionary()


def _marker_ids(tokenizer: Any) -> dict[str, int | None]:
    ids = _IDS.get(tokenizer)
    if ids is None:
        vocab = tokenizer.get_vocab()
        ids = _IDS[tokenizer] = {"thinking_start_token_id": vocab.get("<think>"),
                                 "thinking_end_token_id": vocab.get("</think>")}
    return ids


def with_thinking_markers(params: SamplingParams, tokenizer: Any) -> SamplingParams:
    """The params with the markers' ids when they ask for a thinking budget and do not name
    them; a tokenizer without a one-token </think> cannot take a budget."""
    if params.thinking_token_budget is None or params.thinking_end_token_id is not None:
        return params
    ids = _marker_ids(tokenizer) if tokenizer is not None else {}
    if ids.get("thinking_end_token_id") is None:
        raise ValueError("thinking_token_budget needs a reasoning model: this tokenizer has "
                         "no </think> token")
    return dataclasses.replace(params, **ids)
