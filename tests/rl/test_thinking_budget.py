"""thinking_token_budget: once a request has thought that many tokens (after <think>, or from
its first token when the prompt opened it), </think> is forced and the answer follows; a
budget never cuts a thought that ended on its own, never touches an answer that is not
thinking, and a model without </think> refuses it."""

from __future__ import annotations

import pytest
from oracle import write_tiny_checkpoint

from shoal import LLM, SamplingParams

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**22)
START, END = 500, 501  # token ids standing in for <think> and </think>
PROMPT = {"prompt_token_ids": [7, 8, 9, 10, START]}  # the template opened the thought


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("think"), "llama", seed=0)
    engine = LLM(model=str(path), **ENGINE)
    yield engine
    engine.shutdown()


def params(budget: int | None, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                          thinking_token_budget=budget, thinking_start_token_id=START,
                          thinking_end_token_id=END, **kw)


@pytest.mark.parametrize("budget", [0, 5, 16])
def test_budget_forces_the_end_marker_then_answers(llm, budget) -> None:
    free = llm.generate(PROMPT, params(None), use_tqdm=False)[0].outputs[0].token_ids
    assert END not in free  # (random weights never close a thought themselves)
    out = llm.generate(PROMPT, params(budget), use_tqdm=False)[0].outputs[0].token_ids
    assert out[:budget] == free[:budget]  # the thought itself is untouched
    assert out[budget] == END and len(out) == 24  # then the answer goes on
    assert out.count(END) == 1


def test_budget_counts_only_an_open_thought() -> None:
    sp = params(3)
    opened, closed = [7, START], [7, START, END, 8]
    assert sp.thinking_forced([1, 2], opened) is None
    assert sp.thinking_forced([1, 2, 3], opened) == END  # the prompt opened the thought
    assert sp.thinking_forced([1, 2, 3], closed) is None  # thinking switched off: an answer
    assert sp.thinking_forced([1, 2, 3], [7, 8]) is None  # nothing opened a thought
    assert sp.thinking_forced([4, START, 1, 2], [7]) is None  # what follows <think> counts
    assert sp.thinking_forced([4, START, 1, 2, 3], [7]) == END
    assert sp.thinking_forced([START, 1, 2, 3, END, 9], [7]) is None  # ended: nothing forced


def test_an_answer_without_thinking_is_left_alone(llm) -> None:
    closed = {"prompt_token_ids": [7, 8, 9, 10, START, END]}
    free = llm.generate(closed, params(None), use_tqdm=False)[0].outputs[0].token_ids
    assert llm.generate(closed, params(2), use_tqdm=False)[0].outputs[0].token_ids == free


def test_needs_a_reasoning_tokenizer(llm) -> None:
    with pytest.raises(ValueError, match="</think>"):
        llm.generate(PROMPT, SamplingParams(thinking_token_budget=4), use_tqdm=False)
    with pytest.raises(ValueError, match="thinking_token_budget must be >= 0"):
        SamplingParams(thinking_token_budget=-1)
