"""The embedded SmolLM2-135M-Instruct in float32 against transformers on the same GGUF."""

from __future__ import annotations

import pytest
import torch
from oracle import hf_greedy

from shoal import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("both_cores")]

PROSE = "The history of the printing press begins in the fifteenth century, when"
CODE = "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n"
CHAT = [{"role": "user", "content": "Name three colors of the rainbow."}]


@pytest.fixture(scope="module")
def prompts(smollm_llm) -> dict[str, list[int]]:
    tok = smollm_llm.get_tokenizer()
    chat_text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    return {
        "prose": tok.encode(PROSE),
        "code": tok.encode(CODE),
        "chat": tok.encode(chat_text, add_special_tokens=False),
    }


@pytest.mark.parametrize("name", ["prose", "code", "chat"])
def test_greedy_tokens_and_logits_match_transformers(smollm_llm, hf_smollm, prompts, name):
    ids = prompts[name]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    out = smollm_llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    ref, ref_logits = hf_greedy(hf_smollm, ids, 32)
    assert out.token_ids == ref
    # Last-position distributions: every reported top-5 logprob matches transformers'.
    for step in (0, 15, 31):
        want = torch.log_softmax(ref_logits[step], -1)
        for tid, lp in out.logprobs[step].items():
            assert lp.logprob == pytest.approx(want[tid].item(), abs=2e-4)


def test_chat_api_uses_the_chat_template(smollm_llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=16)
    via_chat = smollm_llm.chat(CHAT, params, use_tqdm=False)[0]
    via_ids = smollm_llm.generate({"prompt_token_ids": prompts["chat"]}, params, use_tqdm=False)[0]
    assert via_chat.prompt_token_ids == prompts["chat"]
    assert via_chat.outputs[0].text == via_ids.outputs[0].text
    assert via_chat.outputs[0].text.strip()


def test_same_prompt_alone_and_in_a_batch_of_32(smollm_llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    alone = smollm_llm.generate({"prompt_token_ids": prompts["prose"]}, params, use_tqdm=False)[0]
    tok = smollm_llm.get_tokenizer()
    others = [f"Write a sentence about the number {i}." for i in range(31)]
    batch = [tok.encode(t) for t in others[:15]] + [prompts["prose"]] + [tok.encode(t) for t in others[15:]]
    outs = smollm_llm.generate([{"prompt_token_ids": b} for b in batch], params, use_tqdm=False)
    assert outs[15].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outs[15].outputs[0].text == alone.outputs[0].text


def test_text_prompt_stop_string_and_detokenized_text(smollm_llm):
    params = SamplingParams(temperature=0, max_tokens=40, stop=["\n"])
    out = smollm_llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0]
    assert "\n" not in out.text
    assert out.finish_reason == "stop"
    assert out.stop_reason == "\n" or out.token_ids[-1] == 2
