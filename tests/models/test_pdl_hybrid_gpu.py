"""PDL (on by default) on hybrid MoE models through the whole engine on an sm_90+ GPU
(skipped without one): tiny Qwen3.5-MoE and Qwen3-Next checkpoints in bf16 with CUDA graphs
give the same greedy tokens with their decode kernels launched with programmatic dependent
launch (shoal/pdl.py: sigmoid gate, conv step, fused linear decode, gate routing, half-decode
experts, the dense GEMVs) as with none (SHOAL_PDL=0), and those kernels did take part."""

from __future__ import annotations

import random
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs an sm_90+ CUDA GPU")

from models.test_qwen3_next import KINDS  # noqa: E402
from oracle import write_tiny_checkpoint  # noqa: E402

from shoal import LLM, SamplingParams, pdl  # noqa: E402


def _generate(path, prompts: list[list[int]]) -> list:
    llm = LLM(model=str(path), dtype="bfloat16", max_model_len=256, max_num_seqs=8,
              attention_backend="triton", gpu_memory_utilization=0.3)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in
                                      zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


@pytest.mark.parametrize("kind", ["qwen3_5_moe_text", "qwen3_next"])
def test_hybrid_kernels_with_pdl_keep_the_tokens(kind, tmp_path, monkeypatch) -> None:
    path = write_tiny_checkpoint(tmp_path / kind, kind, seed=1, **KINDS[kind])
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 40, 17)]
    monkeypatch.setenv("SHOAL_PDL", "0")
    plain = _generate(path, prompts)
    callers = set()  # the modules whose launches took PDL's arguments
    kwargs = pdl.kwargs

    def counted(device):
        got = kwargs(device)
        if got:
            callers.add(sys._getframe(1).f_globals["__name__"].rsplit(".", 1)[-1])
        return got
    monkeypatch.setattr(pdl, "kwargs", counted)
    monkeypatch.delenv("SHOAL_PDL")  # on by default
    with_pdl = _generate(path, prompts)
    assert {"gate_routing", "half_decode_experts", "linear_decode_fused"} <= callers, callers
    for (want, want_lp), (got, got_lp) in zip(plain, with_pdl):
        assert got == want
        assert got_lp == pytest.approx(want_lp, abs=2e-2)  # (the tuner may pick other tiles)
