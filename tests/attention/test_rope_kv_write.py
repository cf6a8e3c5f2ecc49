"""The fused q/k-norm + rotary + KV-cache-write kernel against its PyTorch reference, and the
Triton backend's fused forward against the unfused layers, through the Triton interpreter on
the CPU (see conftest.py; compiled on a GPU when there is one)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from shoal.attention.metadata import build_attention_metadata  # noqa: E402
from shoal.attention.ops.rope_kv_write import (  # noqa: E402
    rope_kv_write,
    rope_kv_write_reference,
)
from shoal.attention.selector import get_attention_backend  # noqa: E402
from shoal.attention.torch_backend import write_kv_cache  # noqa: E402
from shoal.attention.triton_backend import (  # noqa: E402
    TritonAttentionBackend,
    build_triton_attention_metadata,
)
from shoal.layers.norm import RMSNorm  # noqa: E402
from shoal.layers.rotary import RotaryEmbedding  # noqa: E402
from shoal.models.llama import LlamaAttention  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
EPS = 1e-6
BF16 = pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
    INTERPRET, reason="bf16 under the interpreter rounds differently; runs on a GPU"))


def qkv_views(t: int, hq: int, hk: int, d: int, dtype: torch.dtype,
              gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A fused qkv projection output and its q, k, v views, as the model passes them."""
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(DEV, dtype)
    q = qkv[:, :hq * d].view(t, hq, d)
    k = qkv[:, hq * d:(hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d:].view(t, hk, d)
    return qkv, q, k, v


def norm_weights(d: int, dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    return [(torch.randn(d, generator=gen) * 0.5 + 1).to(DEV, dtype) for _ in range(2)]


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("norm", [False, True], ids=["rope", "norm_rope"])
@pytest.mark.parametrize(("d", "rot"), [(64, 64), (128, 128), (64, 32)])
def test_kernel_matches_reference(d: int, rot: int, norm: bool, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(d + rot + norm)
    t, hq, hk, bs = 6, 12, 2, 16  # GQA 6; 12 heads of 128 take two q programs per token
    rope = RotaryEmbedding(d, 100, 10000.0, rot_dim=rot).to(DEV)
    qkv, q, k, v = qkv_views(t, hq, hk, d, dtype, gen)
    qw, kw = norm_weights(d, dtype, gen) if norm else (None, None)
    positions = torch.tensor([0, 15, 16, 99, 40, 7], device=DEV)
    # Last and first slot of a block, slot 0, padding rows (-1) in between.
    slots = torch.tensor([15, 16, -1, 0, 5 * bs - 1, -1], device=DEV)
    cache = torch.randn(2, 5 * bs, hk, d, generator=gen).to(DEV, dtype)

    ref_q, ref_cache = q.clone(), cache.clone()
    rope_kv_write_reference(positions, ref_q, k, v, rope.cos_sin_cache, ref_cache, slots,
                            qw, kw, EPS)
    kv_before = qkv[:, hq * d:].clone()
    rope_kv_write(positions, q, k, v, rope.cos_sin_cache, cache, slots, qw, kw, EPS)

    tol = TOL[dtype]
    torch.testing.assert_close(q, ref_q, atol=tol, rtol=tol)
    torch.testing.assert_close(cache, ref_cache, atol=tol, rtol=tol)
    assert torch.equal(qkv[:, hq * d:], kv_before), "k and v inputs must stay as they were"
    untouched = torch.ones(cache.shape[1], dtype=torch.bool, device=DEV)
    untouched[slots[slots >= 0]] = False
    assert torch.equal(cache[:, untouched], ref_cache[:, untouched])
    if rot < d and not norm:  # the unrotated tail is not rewritten
        assert torch.equal(q[..., rot:], ref_q[..., rot:])


def test_reference_matches_the_unfused_layers() -> None:
    """Anchors the reference: RMSNorm and RotaryEmbedding as the model applies them, then the
    torch backend's cache write."""
    gen = torch.Generator().manual_seed(1)
    t, hq, hk, d = 4, 4, 2, 64
    rope = RotaryEmbedding(d, 50, 1e6).to(DEV)
    q_norm, k_norm = RMSNorm(d, EPS).to(DEV), RMSNorm(d, EPS).to(DEV)
    q_norm.weight.data, k_norm.weight.data = norm_weights(d, torch.float32, gen)
    _, q, k, v = qkv_views(t, hq, hk, d, torch.float32, gen)
    positions = torch.tensor([3, 0, 49, 8], device=DEV)
    slots = torch.tensor([2, 9, 0, 7], device=DEV)
    cache = torch.zeros(2, 12, hk, d, device=DEV)
    want_q, want_k = rope.forward_native(positions, q_norm.forward_native(q),
                                         k_norm.forward_native(k))
    want_cache = cache.clone()
    write_kv_cache(want_cache, want_k, v, slots)
    rope_kv_write_reference(positions, q, k, v, rope.cos_sin_cache, cache, slots,
                            q_norm.weight, k_norm.weight, EPS)
    torch.testing.assert_close(q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(cache, want_cache, atol=1e-6, rtol=1e-6)


def test_backend_fused_forward_matches_unfused() -> None:
    """A mixed step (two decodes, one a block's first slot; a CUDA-graph padding row; a prefill
    chunk after cached context; a fresh prompt) with Qwen3-style q/k norms."""
    gen = torch.Generator().manual_seed(2)
    hq, hk, d, bs, nb = 4, 2, 64, 4, 12
    ctx, qlen = [9, 4, 6, 0], [1, 1, 5, 3]
    tables = [[3, 7, 1], [5, 0], [2, 8, 9], [10]]
    md = build_triton_attention_metadata(
        query_lens=qlen, context_lens=ctx, block_tables=tables, block_size=bs, num_decodes=2,
        sliding_window=None, device=DEV, pad_decodes_to=3)
    pos = [9, 4, 0] + list(range(6, 11)) + [0, 1, 2]  # the padding row reads position 0
    positions = torch.tensor(pos, device=DEV)
    assert md.slot_mapping.tolist()[2] == -1 and md.slot_mapping.tolist()[1] == 0
    rope = RotaryEmbedding(d, 32, 10000.0).to(DEV)
    q_norm, k_norm = RMSNorm(d, EPS).to(DEV), RMSNorm(d, EPS).to(DEV)
    q_norm.weight.data, k_norm.weight.data = norm_weights(d, torch.float32, gen)
    _, q, k, v = qkv_views(len(pos), hq, hk, d, torch.float32, gen)
    cache = torch.randn(2, nb * bs, hk, d, generator=gen).to(DEV)
    backend = TritonAttentionBackend()
    assert backend.fuses_rope_and_cache_write

    ref_q, ref_k = rope(positions, q_norm(q), k_norm(k))
    ref_cache = cache.clone()
    ref = backend.forward(ref_q, ref_k, v, ref_cache, md, d ** -0.5)
    out = backend.forward_fused(q, k, v, positions, rope.cos_sin_cache, q_norm.weight,
                                k_norm.weight, EPS, cache, md, d ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(q, ref_q, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(cache, ref_cache, atol=2e-5, rtol=2e-5)
    assert torch.all(out[2] == 0)  # the padding row


def test_llama_attention_takes_the_fused_path_only_on_triton() -> None:
    """LlamaAttention with q/k norm: the Triton backend (fused) gives the torch backend's
    output and cache; the engine's fuse_rope_kv_write=False turns the fusion off."""
    torch.manual_seed(3)
    cfg = SimpleNamespace(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32, max_position_embeddings=32, rms_norm_eps=1e-5,
                          rope_theta=10000.0)
    attn = LlamaAttention(cfg, torch.float32, qk_norm=True, qkv_bias=False, layer=0).to(DEV)
    for p in attn.parameters():
        p.data = torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0)
    hidden = torch.randn(5, 64, device=DEV)
    kw = dict(query_lens=[1, 4], context_lens=[3, 2], block_tables=[[1], [2, 0]], block_size=4,
              num_decodes=1, sliding_window=None, device=DEV)
    positions = torch.tensor([3, 2, 3, 4, 5], device=DEV)
    cache = torch.randn(2, 16, 2, 32, device=DEV)
    cache[:, 12:] = 0  # block 3: the torch backend's null block

    attn.attn.kv_cache = want_cache = cache.clone()
    assert not attn.attn.fuses_rope
    want = attn(positions, hidden, build_attention_metadata(**kw, null_block=3))
    attn.attn.backend = backend = TritonAttentionBackend()
    attn.attn.kv_cache = got_cache = cache.clone()
    assert attn.attn.fuses_rope
    got = attn(positions, hidden, backend.build_metadata(**kw, null_block=3))
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got_cache, want_cache, atol=2e-5, rtol=2e-5)

    attn.attn.backend = backend = get_attention_backend(DEV, "triton", fuse_rope_kv_write=False)
    attn.attn.kv_cache = cache.clone()
    assert not attn.attn.fuses_rope
    unfused = attn(positions, hidden, backend.build_metadata(**kw, null_block=3))
    torch.testing.assert_close(unfused, want, atol=2e-5, rtol=2e-5)
