"""truncate_prompt_tokens on pooling (LLM.embed's keyword and PoolingParams', vLLM's), and no
prompt at all refused with ValueError, on a tiny random BERT."""

from __future__ import annotations

import pytest

from shoal import LLM, PoolingParams


@pytest.fixture(scope="module")
def bert(tiny_bert):
    path, _ = tiny_bert
    return LLM(str(path))


def test_truncation_keeps_the_tokenizer_s_special_tokens(bert):
    tok = bert.get_tokenizer()
    text = "a b c d e f g h"
    full = bert.embed(text, use_tqdm=False)[0]
    cut = bert.embed(text, truncate_prompt_tokens=5, use_tqdm=False)[0]
    assert len(full.prompt_token_ids) == len(tok.encode(text)) > 5
    assert cut.prompt_token_ids == tok.encode(text, truncation=True, max_length=5)
    assert len(cut.prompt_token_ids) == 5 and cut.prompt_token_ids[-1] == tok.sep_token_id
    same = bert.embed(text, pooling_params=PoolingParams(truncate_prompt_tokens=5),
                      use_tqdm=False)[0]
    assert same.outputs.embedding == cut.outputs.embedding != full.outputs.embedding
    ids = bert.encode({"prompt_token_ids": full.prompt_token_ids}, truncate_prompt_tokens=3,
                      use_tqdm=False)[0]
    assert len(ids.prompt_token_ids) == 3
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        bert.embed(text, truncate_prompt_tokens=10**6, use_tqdm=False)


def test_no_prompt_is_refused(bert):
    for bad in (None, b"x"):
        with pytest.raises(ValueError, match="prompt"):
            bert.embed(bad, use_tqdm=False)
