"""Layers vs direct float64 references: RMSNorm, rotary embedding (neox layout, llama3 and
linear scaling), SiluAndMul, and the sharded weight loaders at tensor-parallel size 1."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from shoal.layers.activation import SiluAndMul
from shoal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from shoal.layers.norm import RMSNorm
from shoal.layers.rotary import RotaryEmbedding, _inv_freq, rope_parameters


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- RMSNorm ---------------------------------------------------------------------------------


def rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rmsnorm_matches_reference(eps: float) -> None:
    g = gen(0)
    norm = RMSNorm(64, eps=eps)
    norm.weight.data.copy_(torch.rand(64, generator=g) + 0.5)
    x = torch.randn(7, 64, generator=g) * 3
    out = norm(x)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), rms_ref(x, norm.weight, eps), atol=1e-5, rtol=1e-5)


def test_rmsnorm_eps_matters_for_tiny_inputs() -> None:
    norm = RMSNorm(8, eps=1e-2)
    x = torch.full((1, 8), 1e-3)
    torch.testing.assert_close(norm(x).double(), rms_ref(x, norm.weight, 1e-2), atol=1e-7,
                               rtol=1e-5)


def test_rmsnorm_with_residual_returns_norm_of_sum_and_the_sum() -> None:
    g = gen(1)
    norm = RMSNorm(32, eps=1e-6)
    norm.weight.data.copy_(torch.randn(32, generator=g))
    x = torch.randn(5, 32, generator=g)
    res = torch.randn(5, 32, generator=g)
    x_in, res_in = x.clone(), res.clone()
    out, new_res = norm.forward_native(x, res)
    torch.testing.assert_close(new_res, x + res)
    torch.testing.assert_close(out.double(), rms_ref(x + res, norm.weight, 1e-6), atol=1e-5,
                               rtol=1e-5)
    # The torch path leaves its inputs as they were; the fused kernels (Triton, the CPU's
    # C++ one) write both results into them, which the models allow for.
    assert torch.equal(x, x_in) and torch.equal(res, res_in)
    out2, new_res2 = norm(x.clone(), res.clone())
    torch.testing.assert_close(new_res2, new_res)
    torch.testing.assert_close(out2, out, atol=1e-5, rtol=1e-5)


def test_rmsnorm_half_precision_keeps_dtype() -> None:
    g = gen(2)
    norm = RMSNorm(64, params_dtype=torch.bfloat16)
    norm.weight.data.copy_((torch.rand(64, generator=g) + 0.5).bfloat16())
    x = (torch.randn(4, 64, generator=g) * 10).bfloat16()
    out = norm(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), rms_ref(x, norm.weight, 1e-6), atol=3e-2, rtol=2e-2)


# ---- rotary ----------------------------------------------------------------------------------


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
             rot_dim: int) -> torch.Tensor:
    """HF-style neox rotation in float64: x*cos + rotate_half(x)*sin on the first rot_dim."""
    freqs = positions.double()[:, None] * inv_freq.double()[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    rot, rest = x.double()[..., :rot_dim], x.double()[..., rot_dim:]
    return torch.cat([rot * cos + rotate_half(rot) * sin, rest], dim=-1)


def plain_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return torch.tensor([1.0 / theta ** (2 * i / dim) for i in range(dim // 2)],
                        dtype=torch.float64)


@pytest.mark.parametrize(("head_dim", "rot_dim"), [(64, None), (32, None), (64, 32)])
def test_rotary_matches_rotate_half_reference(head_dim: int, rot_dim: int | None) -> None:
    g = gen(3)
    max_pos, theta = 4096, 10000.0
    rope = RotaryEmbedding(head_dim, max_pos, theta, rot_dim=rot_dim)
    positions = torch.randint(0, max_pos, (9,), generator=g)
    positions[0] = 0
    positions[1] = max_pos - 1
    q = torch.randn(9, 4, head_dim, generator=g)
    k = torch.randn(9, 2, head_dim, generator=g)
    q_out, k_out = rope(positions, q.clone(), k.clone())  # the fused kernels rotate in place
    rd = rot_dim or head_dim
    inv = plain_inv_freq(rd, theta)
    torch.testing.assert_close(q_out.double(), rope_ref(q, positions, inv, rd), atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(k_out.double(), rope_ref(k, positions, inv, rd), atol=1e-5,
                               rtol=1e-5)
    # Position 0 is the identity, and the pass-through part is untouched.
    torch.testing.assert_close(q_out[0], q[0])
    if rot_dim is not None:
        assert torch.equal(q_out[..., rot_dim:], q[..., rot_dim:])


def test_rotary_preserves_norm_and_relative_position() -> None:
    # q.k after rotation depends only on the position difference.
    g = gen(4)
    rope = RotaryEmbedding(32, 512, 10000.0)
    q = torch.randn(1, 1, 32, generator=g).expand(2, 1, 32)
    k = torch.randn(1, 1, 32, generator=g).expand(2, 1, 32)
    qa, ka = rope(torch.tensor([10, 3]), q, k)
    qb, kb = rope(torch.tensor([107, 100]), q, k)
    dot_a = (qa[0] * ka[1]).sum()
    dot_b = (qb[0] * kb[1]).sum()
    torch.testing.assert_close(dot_a, dot_b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(qa.norm(dim=-1), q.norm(dim=-1))


def llama3_inv_freq_ref(dim: int, theta: float, factor: float, low: float, high: float,
                        old_len: float) -> tuple[list[float], list[str]]:
    out, kinds = [], []
    low_wl, high_wl = old_len / low, old_len / high
    for i in range(dim // 2):
        f = 1.0 / theta ** (2 * i / dim)
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(f)
            kinds.append("high")
        elif wl > low_wl:
            out.append(f / factor)
            kinds.append("low")
        else:
            s = (old_len / wl - low) / (high - low)
            out.append((1 - s) * f / factor + s * f)
            kinds.append("mid")
    return out, kinds


def test_llama3_scaling_inv_freq() -> None:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    ref, kinds = llama3_inv_freq_ref(128, 500000.0, 8.0, 1.0, 4.0, 8192.0)
    assert {"high", "mid", "low"} <= set(kinds)  # all three regimes are exercised
    inv = _inv_freq(128, 500000.0, scaling)
    torch.testing.assert_close(inv, torch.tensor(ref, dtype=torch.float64), atol=0, rtol=1e-12)
    # The module's cos/sin cache uses these frequencies.
    rope = RotaryEmbedding(128, 2048, 500000.0, scaling)
    pos = torch.tensor([0, 1, 333, 2047])
    freqs = pos.double()[:, None] * torch.tensor(ref, dtype=torch.float64)[None, :]
    expect = torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()
    torch.testing.assert_close(rope.cos_sin_cache[pos], expect, atol=1e-6, rtol=0)


def test_llama3_scaling_accepts_legacy_type_key() -> None:
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    ref, _ = llama3_inv_freq_ref(64, 500000.0, 8.0, 1.0, 4.0, 8192.0)
    torch.testing.assert_close(_inv_freq(64, 500000.0, scaling),
                               torch.tensor(ref, dtype=torch.float64), atol=0, rtol=1e-12)


def test_linear_scaling_and_unknown_scaling() -> None:
    inv = _inv_freq(32, 10000.0, {"rope_type": "linear", "factor": 4.0})
    torch.testing.assert_close(inv, plain_inv_freq(32, 10000.0) / 4.0, atol=0, rtol=1e-12)
    with pytest.raises(ValueError, match="unsupported rope scaling"):
        _inv_freq(32, 10000.0, {"rope_type": "longrope", "factor": 4.0})


def test_rope_parameters_both_spellings() -> None:
    v4 = SimpleNamespace(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    assert rope_parameters(v4) == (500000.0, {"rope_type": "llama3", "factor": 8.0})
    v4_default = SimpleNamespace(rope_theta=1e6, rope_scaling={"rope_type": "default"})
    assert rope_parameters(v4_default) == (1e6, None)
    v5 = SimpleNamespace(rope_parameters={"rope_theta": 1e4, "rope_type": "default"})
    assert rope_parameters(v5) == (1e4, None)
    v5_scaled = SimpleNamespace(rope_parameters={"rope_theta": 5e5, "rope_type": "linear",
                                                 "factor": 2.0})
    theta, scaling = rope_parameters(v5_scaled)
    assert theta == 5e5 and scaling is not None and scaling["factor"] == 2.0
    assert rope_parameters(SimpleNamespace()) == (10000.0, None)


# ---- activation ------------------------------------------------------------------------------


def test_silu_and_mul() -> None:
    g = gen(5)
    x = torch.randn(3, 5, 2 * 16, generator=g) * 4
    out = SiluAndMul()(x)
    assert out.shape == (3, 5, 16)
    xd = x.double()
    gate, up = xd[..., :16], xd[..., 16:]
    ref = gate / (1 + torch.exp(-gate)) * up
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


# ---- linear layers and weight loaders --------------------------------------------------------


def test_qkv_weight_loader_places_shards() -> None:
    g = gen(6)
    hidden, head_dim, nh, nkv = 16, 4, 4, 2
    layer = QKVParallelLinear(hidden, head_dim, nh, nkv, bias=True)
    assert layer.weight.shape == ((nh + 2 * nkv) * head_dim, hidden)
    wq = torch.randn(nh * head_dim, hidden, generator=g)
    wk = torch.randn(nkv * head_dim, hidden, generator=g)
    wv = torch.randn(nkv * head_dim, hidden, generator=g)
    bq, bk, bv = (torch.randn(w.shape[0], generator=g) for w in (wq, wk, wv))
    # Load out of order: offsets, not call order, decide the placement.
    for shard, w, b in (("v", wv, bv), ("q", wq, bq), ("k", wk, bk)):
        layer.weight.weight_loader(layer.weight, w, shard)
        layer.bias.weight_loader(layer.bias, b, shard)
    q_end, k_end = nh * head_dim, (nh + nkv) * head_dim
    assert torch.equal(layer.weight[:q_end], wq)
    assert torch.equal(layer.weight[q_end:k_end], wk)
    assert torch.equal(layer.weight[k_end:], wv)
    assert torch.equal(layer.bias, torch.cat([bq, bk, bv]))
    x = torch.randn(3, hidden, generator=g)
    y = layer(x)
    torch.testing.assert_close(y, torch.cat([F.linear(x, wq, bq), F.linear(x, wk, bk),
                                             F.linear(x, wv, bv)], dim=-1))


def test_qkv_weight_loader_rejects_wrong_shape() -> None:
    layer = QKVParallelLinear(16, 4, 4, 2)
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.weight.weight_loader(layer.weight, torch.zeros(8, 15), "k")


def test_merged_column_weight_loader_places_gate_and_up() -> None:
    g = gen(7)
    hidden, inter = 8, 12
    layer = MergedColumnParallelLinear(hidden, [inter, inter])
    assert layer.weight.shape == (2 * inter, hidden)
    gate = torch.randn(inter, hidden, generator=g)
    up = torch.randn(inter, hidden, generator=g)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    assert torch.equal(layer.weight[:inter], gate)
    assert torch.equal(layer.weight[inter:], up)
    x = torch.randn(4, hidden, generator=g)
    torch.testing.assert_close(SiluAndMul()(layer(x)), F.silu(x @ gate.T) * (x @ up.T))


def test_merged_column_unequal_sizes() -> None:
    g = gen(8)
    layer = MergedColumnParallelLinear(4, [3, 5, 2])
    parts = [torch.randn(n, 4, generator=g) for n in (3, 5, 2)]
    for i in (2, 0, 1):
        layer.weight.weight_loader(layer.weight, parts[i], i)
    assert torch.equal(layer.weight.data, torch.cat(parts))


def test_column_and_row_parallel_world_size_one() -> None:
    g = gen(9)
    col = ColumnParallelLinear(6, 10, bias=True)
    w, b = torch.randn(10, 6, generator=g), torch.randn(10, generator=g)
    col.weight.weight_loader(col.weight, w)
    col.bias.weight_loader(col.bias, b)
    row = RowParallelLinear(10, 6, bias=True)
    w2, b2 = torch.randn(6, 10, generator=g), torch.randn(6, generator=g)
    row.weight.weight_loader(row.weight, w2)
    row.bias.weight_loader(row.bias, b2)
    x = torch.randn(2, 6, generator=g)
    torch.testing.assert_close(row(col(x)), F.linear(F.linear(x, w, b), w2, b2))
    with pytest.raises(ValueError, match="shape mismatch"):
        row.weight.weight_loader(row.weight, torch.zeros(7, 10))


def test_vocab_embedding_and_lm_head() -> None:
    g = gen(10)
    vocab, dim = 11, 6
    table = torch.randn(vocab, dim, generator=g)
    emb = VocabParallelEmbedding(vocab, dim)
    emb.weight.weight_loader(emb.weight, table)
    ids = torch.tensor([[0, 10, 3], [7, 7, 1]])
    assert torch.equal(emb(ids), table[ids])
    head = ParallelLMHead(vocab, dim)
    head.weight.weight_loader(head.weight, table)
    h = torch.randn(4, dim, generator=g)
    logits = head.compute_logits(h)
    assert logits.shape == (4, vocab)
    torch.testing.assert_close(logits, h @ table.T)
