"""allowed_token_ids and logprob_token_ids through the whole offline engine (tiny random
model): every sampled token is allowed, each position reports exactly the sampled token and
the asked ids, with the model's true logprobs; other requests in the batch are untouched."""

from __future__ import annotations

import pytest
from engine_helpers import tiny_llm

from shoal.sampling_params import SamplingParams

PROMPT = {"prompt_token_ids": [5, 77, 300, 12]}


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return tiny_llm(tiny_llama_dir)


def test_allowed_and_logprob_token_ids_in_a_mixed_batch(llm) -> None:
    allowed, asked = [100, 200, 300], [5, 6, 400]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                             allowed_token_ids=allowed, logprob_token_ids=asked),
              SamplingParams(temperature=0.8, seed=1, max_tokens=6, ignore_eos=True,
                             allowed_token_ids=allowed),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)]
    restricted, sampled, free = llm.generate([PROMPT] * 3, params, use_tqdm=False)
    out = restricted.outputs[0]
    assert set(out.token_ids) <= set(allowed)
    assert set(sampled.outputs[0].token_ids) <= set(allowed)
    assert not set(free.outputs[0].token_ids) <= set(allowed)
    assert len(free.outputs[0].logprobs[0]) == 2  # greedy: the sampled token is the top-1
    # Positions hold the sampled token and the asked ids, with the model's raw logprobs.
    full = PROMPT["prompt_token_ids"] + list(out.token_ids)
    scored = llm.generate([{"prompt_token_ids": full}],
                          SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    for i, (tok, position) in enumerate(zip(out.token_ids, out.logprobs)):
        assert set(position) == {tok, *asked}
        truth = scored.prompt_logprobs[len(PROMPT["prompt_token_ids"]) + i][tok].logprob
        assert position[tok].logprob == pytest.approx(truth, abs=1e-4)
    assert out.cumulative_logprob == pytest.approx(
        sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs)), abs=1e-4)


def test_out_of_vocab_ids_are_refused_before_anything_runs(llm) -> None:
    for field in ("allowed_token_ids", "logprob_token_ids"):
        with pytest.raises(ValueError, match=f"{field} token id 512 is out of range"):
            llm.generate([PROMPT], SamplingParams(**{field: [1, 512]}), use_tqdm=False)
