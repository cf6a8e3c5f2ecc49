"""Every format, end to end on the CPU in float32: a tiny Llama, Qwen3-MoE and DeepSeek-V3
saved quantized, loaded by `shoal.LLM`, against the same model saved dense with the
dequantized weights (computed by the test's own quantizer from the integer codes).

The weights shoal streams must equal the dense twin's, and greedy decoding must give the
same tokens: exactly for W8A8 formats (activations stay unquantized on the CPU: the same
computation as the dense model), and for weight-only formats up to a divergence at a near
tie of the dense run's top two logits."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
import quant_checkpoints as qc
import torch
from quant_cases import CASES, Case, case_for

from shoal import LLM, SamplingParams
from shoal.loader import load_model

MODELS = ("llama", "qwen3_moe", "deepseek_v3")
# Both runs compute in float32 from weights equal to float32 rounding: logits agree to ~1e-5,
# so only a top-two gap below this can swap.
NEAR_TIE = 1e-3


def _ignored(module: str, ignore: tuple[str, ...]) -> bool:
    return any(re.match(t[3:], module) if t.startswith("re:") else t == module for t in ignore)


def write_pair(model: str, case: Case, dense: dict[str, Path],
               out: Path) -> tuple[Path, Path]:
    """(the checkpoint as `case` stores it, its dequantized dense twin)."""
    if case.quantize is None:  # online FP8: the dense checkpoint, quantized by shoal at load
        def quantize(w):
            return qc.Quantized({"weight": w}, qc.online_fp8_reference(w))
    else:
        quantize = case.quantize
    return qc.quantize_folder(dense[model], out, quantize, case.config,
                              select=lambda m: not _ignored(m, case.ignore))


def greedy(folder: Path, quantization: str | None = None) -> list:
    llm = LLM(model=str(folder), dtype="float32", quantization=quantization, block_size=16,
              num_gpu_blocks_override=64, max_model_len=128)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(2, 24))] for _ in range(3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def assert_tokens_match_up_to_a_near_tie(got: list, ref: list, exact: bool) -> None:
    for g, r in zip(got, ref):
        for pos, (gt, rt) in enumerate(zip(g.token_ids, r.token_ids)):
            if gt == rt:
                continue
            top = r.logprobs[pos]
            assert not exact and gt in top, (
                f"token {pos}: {gt} where the dense model chose {rt} (its top 5: "
                f"{ {t: round(lp.logprob, 4) for t, lp in top.items()} })")
            gap = top[rt].logprob - top[gt].logprob
            assert gap < NEAR_TIE, f"token {pos}: {gt} vs {rt}, not a near tie (gap {gap:.4g})"
            break  # the contexts differ from here on


@pytest.mark.parametrize("fmt", list(CASES))
@pytest.mark.parametrize("model", MODELS)
def test_quantized_checkpoint_runs_as_its_dequantized_twin(model, fmt, dense_checkpoints,
                                                           tmp_path):
    case = case_for(model, fmt)
    quant, dense = write_pair(model, case, dense_checkpoints, tmp_path)
    got = dict(load_model(str(quant), quantization=case.quantization).weights())
    want = dict(load_model(str(dense)).weights())
    assert sorted(got) == sorted(want)
    for name, w in want.items():  # bit for bit: each is one float32 product of code and scale
        assert torch.equal(got[name], w), name
    assert_tokens_match_up_to_a_near_tie(greedy(quant, case.quantization), greedy(dense),
                                         exact=case.w8a8)


def test_gptq_biases_real_ones_load_and_zero_ones_are_dropped(tmp_path):
    """Qwen2's q/k/v biases pass through; the zero biases some exporters give every other
    quantized layer are dropped (the model has no such parameter)."""
    from oracle import write_tiny_checkpoint

    case = CASES["gptq-4bit-g32"]
    src = write_tiny_checkpoint(tmp_path / "qwen2", "qwen2", seed=14)
    quant, dense = write_pair("qwen2", case, {"qwen2": src}, tmp_path)
    tensors = qc.read_tensors(quant)
    for name in list(tensors):
        if name.endswith((".o_proj.qweight", ".down_proj.qweight")):
            tensors[name.removesuffix("qweight") + "bias"] = torch.zeros(64)
    quant = qc.write_folder(tmp_path / "with_biases", quant, tensors, case.config)
    got = dict(load_model(str(quant)).weights())
    want = dict(load_model(str(dense)).weights())
    assert sorted(got) == sorted(want) and any(n.endswith("q_proj.bias") for n in got)
    assert all(torch.equal(got[n], w) for n, w in want.items())
    assert_tokens_match_up_to_a_near_tie(greedy(quant), greedy(dense), exact=False)
