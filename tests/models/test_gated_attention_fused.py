"""Gated attention (Qwen3-Next, Qwen3.5) on the Triton backend, whose fused kernel applies
the per-head q/k norms and the partial rotary while writing the cache, on the q projection's
strided views (q in place; shoal/models/qwen3_next.py GatedAttention), interpreted on the
CPU: the same greedy tokens and logprobs within 1e-4 (float32) as the torch backend's unfused
path, in a batch of prompts of several lengths (chunked prefill beside decodes)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from oracle import write_tiny_checkpoint  # noqa: E402
from worker.test_hybrid_prefill_graphs_cpu import LINEAR, MOE, _same  # noqa: E402

from shoal import LLM, SamplingParams  # noqa: E402
from shoal.attention import triton_backend  # noqa: E402

PROMPTS = [[(7 * i + 3 * j) % 500 + 3 for j in range(n)] for i, n in enumerate((5, 23, 41))]


def _run(path, **engine) -> list:
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=32, max_model_len=128,
              num_gpu_blocks_override=32, max_num_seqs=4, **engine)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_fused_gated_attention_gives_the_unfused_tokens(model_type, tmp_path, monkeypatch):
    extra = MOE if model_type == "qwen3_next" else {}
    path = write_tiny_checkpoint(tmp_path, model_type, seed=5, **LINEAR, **extra)
    want = _run(path, attention_backend="torch")  # (the unfused path on a GPU too)
    calls = []
    fused = triton_backend.rope_kv_write

    def counted(*args, **kwargs):
        calls.append(args[1].stride(1))  # q's head stride: 2 x head_dim, the strided view
        return fused(*args, **kwargs)

    monkeypatch.setattr(triton_backend, "rope_kv_write", counted)
    got = _run(path, attention_backend="triton")
    assert calls and set(calls) == {2 * LINEAR["head_dim"]}
    _same(got, want)  # tokens, and logprobs within 1e-4
