"""transformers 5.25 as a second oracle: where it can dequantize the same quantized folder on
the CPU (compressed-tensors with dequantize=True, fine-grained FP8, which falls back to
dequantizing without a GPU), its greedy tokens must be shoal's. Where it cannot, the test
says why (measured on transformers 5.25 and compressed-tensors 0.20)."""

from __future__ import annotations

import importlib.util
import random
from dataclasses import replace

import pytest
import quant_checkpoints as qc
import torch
from oracle import hf_greedy
from quant_cases import CASES, case_for
from reduced_precision import assert_greedy_matches_up_to_a_near_tie
from test_quantized_checkpoints import MODELS, write_pair

from shoal import LLM, SamplingParams

# Both run float32 from the same dequantized weights: only a near exact tie may swap.
REL_MARGIN = 1e-4
MOE = ("qwen3_moe", "deepseek_v3")
_MOE_FUSION = ("transformers 5.25 stacks MoE experts before decompressing them, which fails "
               "for this compressed-tensors format (zero points / int8 weights not collected)")


def _skip_reason(model: str, fmt: str) -> str | None:
    if fmt.startswith("gptq") and importlib.util.find_spec("gptqmodel") is None:
        return "transformers reads GPTQ only through gptqmodel (GPU kernels; not installed)"
    if fmt.startswith("awq") and importlib.util.find_spec("awq") is None:
        return "transformers reads AWQ only through autoawq (not installed)"
    if fmt == "fp8-channel-static":
        return ("transformers' FP8 (fine-grained) reads weight_scale_inv blocks only, not "
                "per-channel weight_scale")
    if fmt == "online-fp8":
        return "transformers quantizes to FP8 on the fly only on a GPU"
    if model in MOE and fmt in ("ct-w4a16-asym", "ct-w8a8-int8", "ct-w8a16-naive"):
        return _MOE_FUSION
    return None


@pytest.mark.parametrize("fmt", list(CASES))
@pytest.mark.parametrize("model", MODELS)
def test_transformers_dequantizes_to_shoals_tokens(model, fmt, dense_checkpoints, tmp_path):
    reason = _skip_reason(model, fmt)
    if reason:
        pytest.skip(reason)
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    case = case_for(model, fmt)
    if fmt == "fp8-block":
        # transformers takes the tile size from the scale grid (rows // scale rows), which
        # mis-sizes partial edge tiles (DeepSeek's 48-row kv_a_proj in 32-row tiles): here
        # 16x16 tiles, which divide every weight.
        case = replace(case, quantize=lambda w: qc.fp8_block(w, (16, 16)),
                       config=dict(case.config, weight_block_size=[16, 16]))
    quant, _ = write_pair(model, case, dense_checkpoints, tmp_path)
    kwargs = ({"quantization_config": CompressedTensorsConfig(dequantize=True)}
              if fmt.startswith("ct-") else {})
    hf = AutoModelForCausalLM.from_pretrained(quant, dtype=torch.float32, **kwargs).eval()

    llm = LLM(model=str(quant), dtype="float32", block_size=16, num_gpu_blocks_override=64,
              max_model_len=128)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(2, 20))] for _ in range(2)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ref, ref_logits = hf_greedy(hf, prompt, 8)
        assert_greedy_matches_up_to_a_near_tie(list(out.outputs[0].token_ids), ref, ref_logits,
                                               rel_margin=REL_MARGIN)
