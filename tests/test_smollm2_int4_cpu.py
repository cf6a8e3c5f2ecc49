"""The embedded SmolLM2-135M (a Q4_1 GGUF) with its 4-bit weights run by torch's int4 CPU
kernel (cpu_int4_matmul=True, and the bfloat16 default that packs small steps only): the
first 16 greedy tokens of each reference prompt are those of transformers on the dequantized
file in float32, up to a near tie of transformers' logits (bfloat16 activations: which side
of a near tie a run takes depends on the CPU's kernels, see reduced_precision.py)."""

from __future__ import annotations

import pytest
from oracle import hf_greedy
from reduced_precision import assert_greedy_matches_up_to_a_near_tie
from test_smollm2_vs_hf import CHAT, CODE, PROSE

from shoal import SamplingParams
from shoal.layers import int4_cpu

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("both_cores"),
              pytest.mark.skipif(not int4_cpu.supported(), reason="no int4 CPU kernel")]


@pytest.fixture(scope="module", params=["all", "bf16-default"])
def int4_llm(request):
    from shoal import LLM

    extra = ({"cpu_int4_matmul": True} if request.param == "all"
             else {"dtype": "bfloat16"})
    llm = LLM(kv_cache_memory_bytes=256 << 20, max_model_len=2048, **extra)
    llm.mode = request.param
    yield llm
    llm.shutdown()


def test_linear_layers_run_int4(int4_llm):
    model = int4_llm.llm_engine.core.runner.model
    layers = [m for m in model.modules() if hasattr(m, "int4")]
    assert layers and all(m.int4 is not None for m in layers)
    small_only = int4_llm.mode == "bf16-default"
    assert all((m.int4.max_rows is not None) == small_only for m in layers)
    assert all((m.weight.numel() > 0) == small_only for m in layers)


@pytest.mark.parametrize("name", ["prose", "code", "chat"])
def test_first_16_greedy_tokens_match_transformers(int4_llm, hf_smollm, name):
    tok = int4_llm.get_tokenizer()
    ids = {"prose": lambda: tok.encode(PROSE), "code": lambda: tok.encode(CODE),
           "chat": lambda: tok.encode(tok.apply_chat_template(
               CHAT, tokenize=False, add_generation_prompt=True), add_special_tokens=False)}[name]()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out = int4_llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0]
    ref, ref_logits = hf_greedy(hf_smollm, ids, 16)
    assert_greedy_matches_up_to_a_near_tie(out.token_ids, ref, ref_logits)
