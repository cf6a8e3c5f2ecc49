"""Attention logit soft-capping (Gemma 2: score -> cap * tanh(score / cap)) in the Triton
kernels against the torch backend, in the interpreter on the CPU (see conftest.py): the
decode kernel (split-K, padded rows, a window, sinks beside the cap), the prefill kernel
(chunks after a context, whole unmasked key tiles, a window), the CUDA-graph buffers; the
layer's refusal of a backend without a cap; and a tiny Gemma 2 through the engine on the
Triton backend (rotary fused into the cache write) against transformers' greedy tokens.

Scores are made large (q scaled up) and the cap small, so capping changes every output:
each kernel check also asserts the uncapped reference is far from the capped one."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from shoal.attention.metadata import build_attention_metadata  # noqa: E402
from shoal.attention.ops.paged_decode import paged_decode  # noqa: E402
from shoal.attention.torch_backend import TorchAttentionBackend, paged_attention  # noqa: E402
from shoal.attention.triton_backend import (  # noqa: E402
    TritonAttentionBackend,
    build_triton_attention_metadata,
    paged_attention_triton,
)
from shoal.layers.attention import Attention  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CAP = 1.5
HQ, HK, D, BS = 4, 2, 16, 4


@dataclass
class Seq:
    ctx: int  # tokens already in the cache
    q: int  # new tokens this step


def check_step(seqs: list[Seq], num_decodes: int, *, window: int | None = None,
               sinks: bool = False, num_splits: int | None = None,
               pad_decodes_to: int | None = None, seed: int = 0) -> None:
    """One step through the Triton path with the cap vs the torch backend with it (fp32)."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(s.ctx + s.q) // BS) for s in seqs]
    nb = sum(need) + 1
    perm = torch.randperm(nb, generator=gen).tolist()
    tables = [perm[sum(need[:i]):sum(need[:i + 1])] for i in range(len(seqs))]
    cache = torch.randn(2, (nb + 1) * BS, HK, D, generator=gen)
    cache[:, nb * BS:] = 0  # the reference's null block
    t = sum(s.q for s in seqs)
    q = 4 * torch.randn(t, HQ, D, generator=gen)  # scores of several caps
    k, v = (torch.randn(t, HK, D, generator=gen) for _ in range(2))
    sink = 2 * torch.randn(HQ, generator=gen) if sinks else None
    q, k, v, cache = (x.to(DEV) for x in (q, k, v, cache))
    sink = sink.to(DEV) if sink is not None else None
    kw = dict(query_lens=[s.q for s in seqs], context_lens=[s.ctx for s in seqs],
              block_tables=tables, block_size=BS, num_decodes=num_decodes,
              sliding_window=window, device=DEV)
    md = build_attention_metadata(**kw, null_block=nb)
    scale = 1 / math.sqrt(D)
    ref = paged_attention(q, k, v, cache.clone(), md, scale, sinks=sink, softcap=CAP)
    uncapped = paged_attention(q, k, v, cache.clone(), md, scale, sinks=sink)
    assert (ref - uncapped).abs().max() > 0.1  # the cap bends these scores

    tmd = build_triton_attention_metadata(**kw, pad_decodes_to=pad_decodes_to,
                                          decode_num_splits=num_splits)
    n_pad = tmd.num_decode_rows - num_decodes
    if n_pad:  # padded decode rows (as a CUDA graph has) after the real ones
        def padded(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x[:num_decodes], torch.ones_like(x[:1]).expand(n_pad, -1, -1),
                              x[num_decodes:]])
        q, k, v = padded(q), padded(k), padded(v)
    out = paged_attention_triton(q, k, v, cache, tmd, scale, sinks=sink, softcap=CAP)
    real = torch.cat([out[:num_decodes], out[tmd.num_decode_rows:]])
    torch.testing.assert_close(real, ref, atol=2e-5, rtol=2e-5)
    assert torch.all(out[num_decodes:tmd.num_decode_rows] == 0)


@pytest.mark.parametrize("window", [None, 5])
def test_mixed_step_with_cap(window: int | None) -> None:
    # decodes (one on a block boundary), a chunk after a context, a first chunk
    check_step([Seq(9, 1), Seq(7, 1), Seq(11, 5), Seq(0, 6)], 2, window=window, seed=1)


def test_split_k_decode_with_cap_sinks_window_and_padding() -> None:
    # 4 splits of a 150-token context, a short row leaving splits empty, 2 padding rows
    check_step([Seq(150, 1), Seq(3, 1)], 2, window=70, sinks=True, num_splits=4,
               pad_decodes_to=4, seed=2)


@pytest.mark.parametrize("window", [None, 40])
def test_prefill_over_whole_key_tiles_with_cap_and_sinks(window: int | None) -> None:
    # 80 cached keys: whole 32-key tiles before the chunk take the unmasked path
    check_step([Seq(80, 5), Seq(2, 3)], 0, window=window, sinks=True, seed=3)


def test_graph_buffers_carry_the_cap() -> None:
    """A decode graph's metadata, refilled per step: the cap is a launch constant."""
    gen = torch.Generator().manual_seed(4)
    backend = TritonAttentionBackend()
    buf = backend.alloc_graph_buffers(2, 2, 4, DEV, block_size=BS, sliding_window=None)
    md = backend.graph_metadata(buf, 2, 1)
    cache = torch.randn(2, 9 * BS, HK, D, generator=gen).to(DEV)
    cache[:, 8 * BS:] = 0
    ctx, tables = [9], [[3, 7, 1]]
    backend.fill_graph_buffers(buf, 2, 1, ctx, tables, [1 * BS + 1])
    q = (4 * torch.randn(2, HQ, D, generator=gen)).to(DEV)
    k, v = (torch.randn(2, HK, D, generator=gen).to(DEV) for _ in range(2))
    got = backend.forward(q, k, v, cache.clone(), md, 0.25, softcap=CAP)
    ref_md = build_attention_metadata(query_lens=[1], context_lens=ctx, block_tables=tables,
                                      block_size=BS, num_decodes=1, sliding_window=None,
                                      device=DEV, null_block=8)
    ref = paged_attention(q[:1], k[:1], v[:1], cache.clone(), ref_md, 0.25, softcap=CAP)
    torch.testing.assert_close(got[:1], ref, atol=2e-5, rtol=2e-5)
    assert torch.all(got[1:] == 0)


def test_a_bad_cap_is_refused() -> None:
    q = torch.zeros(1, HQ, D, device=DEV)
    cache = torch.zeros(2, BS, HK, D, device=DEV)
    tables = torch.zeros(1, 1, dtype=torch.int32, device=DEV)
    lens = torch.ones(1, dtype=torch.int32, device=DEV)
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="softcap must be a positive finite"):
            paged_decode(q, cache, tables, lens, BS, 0.25, softcap=bad)


class _Recorder(TorchAttentionBackend):
    """Fuses rotary (as the Triton backend does) and records what forward_fused is given."""

    name = "recorder"
    fuses_rope_and_cache_write = True

    def forward_fused(self, q, k, v, positions, cos_sin_cache, q_norm_weight, k_norm_weight,
                      eps, kv_cache, md, scale, sinks=None, **kw):
        self.kw = kw
        return q


def test_the_layer_hands_its_cap_to_the_fused_path_and_refuses_a_backend_without() -> None:
    from shoal.layers.rotary import get_rope

    layer = Attention(HQ, HK, D, softcap=CAP)
    layer.backend = _Recorder()
    layer.kv_cache = torch.zeros(2, BS, HK, D)
    rope = get_rope(D, 64, 10000.0, None, use_triton_ops=False)
    q, kv = torch.zeros(1, HQ, D), torch.zeros(1, HK, D)
    layer.forward_rope(torch.zeros(1, dtype=torch.long), q, kv, kv, rope, None, None, md=None)
    assert layer.backend.kw == {"softcap": CAP}

    class NoCap(_Recorder):
        supports_softcap = False

    with pytest.raises(NotImplementedError, match="no attention soft-capping; use "
                                                  "attention_backend='torch'"):
        layer.backend = NoCap()  # refused when bound, before any step
    Attention(HQ, HK, D).backend = NoCap()  # a layer without a cap takes it


def test_tiny_gemma2_on_the_triton_backend_matches_transformers(tmp_path) -> None:
    """Sliding and full layers, attention and final caps; prompts past the window, in
    chunked prefill steps beside decodes; q/k rotary fused into the Triton cache write."""
    from oracle import check_against_hf, randomize_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from shoal import LLM, SamplingParams

    cfg = AutoConfig.for_model(
        "gemma2", vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=24,
        sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        rms_norm_eps=1e-6, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, architectures=["Gemma2ForCausalLM"])
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    randomize_weights(hf)
    hf.save_pretrained(tmp_path)
    prompts = [[(5 * i) % 120 + 3 for i in range(11)], [7, 9, 11]]
    with torch.no_grad():  # the attention cap moves these logits: dropping it would fail
        ids = torch.tensor(prompts[:1])
        capped = torch.log_softmax(hf(ids).logits, -1)
        for layer in hf.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        assert (torch.log_softmax(hf(ids).logits, -1) - capped).abs().max() > 1e-2
        for layer in hf.model.layers:
            layer.self_attn.attn_logit_softcapping = 2.0
    llm = LLM(model=str(tmp_path), device="cpu", dtype="float32", attention_backend="triton",
              max_num_batched_tokens=8, block_size=4, num_gpu_blocks_override=32,
              max_model_len=32, enforce_eager=True)
    runner = llm.llm_engine.core.runner
    assert runner.backend.name == "triton" and runner.backend.fuses_rope_and_cache_write
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    check_against_hf(outs, prompts, hf, 3)
