"""The fused-MoE Triton kernel against the PyTorch expert loop, run on the CPU through the
Triton interpreter (compiled on a GPU), and the pieces around it: grouping pairs by expert,
softmax top-k routing, the capture-safe dense fallback and the stacked-weight loader."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")  # the interpreter on the CPU: see conftest.py

from shoal.layers.moe.align import group_by_expert, max_blocks  # noqa: E402
from shoal.layers.moe.layer import FusedMoE  # noqa: E402
from shoal.layers.moe.router import select_experts  # noqa: E402
from shoal.layers.moe.torch_experts import experts_dense, experts_torch  # noqa: E402
from shoal.layers.moe.triton_experts import choose_tiles, experts_triton  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def make(t: int, e: int, k: int, h: int, inter: int, seed: int,
         ids: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """x [t, h], w13 [e, 2i, h], w2 [e, h, i] and a softmax top-k routing (or `ids` with
    random weights)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, inter, generator=g) / inter ** 0.5
    if ids is None:
        weights, ids = select_experts(torch.randn(t, e, generator=g) * 2, k, renormalize=True)
    else:
        weights = torch.rand(ids.shape, generator=g) + 0.1
    return x, w13, w2, weights, ids


def per_token_reference(x, w13, w2, weights, ids) -> torch.Tensor:
    """Token by token, slot by slot, in float64: the definition of the layer."""
    x, w13, w2, weights = (a.double() for a in (x, w13, w2, weights))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


# ---- grouping pairs by expert ----------------------------------------------------------------


def check_groups(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    n = ids.numel()
    groups = group_by_expert(ids.to(DEV), num_experts, block_m)
    blocks = max_blocks(n, num_experts, block_m)
    assert groups.sorted_ids.shape == (blocks * block_m,) and groups.sorted_ids.dtype == torch.int32
    assert groups.block_expert.shape == (blocks,) and groups.block_expert.dtype == torch.int32
    sorted_ids = groups.sorted_ids.cpu().view(blocks, block_m)
    block_expert = groups.block_expert.cpu()
    flat = ids.reshape(-1)
    real = sorted_ids[sorted_ids < n]
    assert sorted(real.tolist()) == list(range(n))  # every pair exactly once
    assert torch.all(sorted_ids[sorted_ids >= n] == n)  # the rest is padding
    seen = []
    for b in range(blocks):
        row = sorted_ids[b][sorted_ids[b] < n]
        if block_expert[b] < 0:
            assert row.numel() == 0
            continue
        assert row.numel() > 0  # no block of pure padding before the tail
        assert torch.all(flat[row.long()] == block_expert[b])
        seen.append(int(block_expert[b]))
    assert seen == sorted(seen)  # experts in order, their blocks contiguous
    used = block_expert >= 0
    assert torch.all(used[: int(used.sum())])  # used blocks first, then the -1 tail
    for e in range(num_experts):  # token order kept within an expert
        mine = real[flat[real.long()] == e].tolist()
        assert mine == sorted(mine)


def test_group_by_expert_random_routing() -> None:
    _, _, _, _, ids = make(9, 8, 3, 16, 16, seed=0)
    check_groups(ids, 8, 16)
    check_groups(ids, 8, 4)


def test_group_by_expert_one_expert_spans_blocks() -> None:
    ids = torch.full((40, 1), 3)
    check_groups(ids, 4, 16)
    groups = group_by_expert(ids.to(DEV), 4, 16)
    assert groups.block_expert.tolist()[:3] == [3, 3, 3]


def test_group_shapes_do_not_depend_on_routing() -> None:
    """What a CUDA graph needs: the same T, k and E give the same buffers for any routing."""
    spread = torch.arange(12).view(6, 2) % 8
    skewed = torch.tensor([[0, 1]] * 6)
    a, b = (group_by_expert(i.to(DEV), 8, 16) for i in (spread, skewed))
    assert a.sorted_ids.shape == b.sorted_ids.shape
    assert a.block_expert.shape == b.block_expert.shape
    check_groups(spread, 8, 16)
    check_groups(skewed, 8, 16)


# ---- the Triton kernel -----------------------------------------------------------------------


CASES = {
    "one_token_top2": dict(t=1, e=8, k=2, h=64, inter=32),
    "top1": dict(t=7, e=8, k=1, h=64, inter=32),
    "top3_ragged_dims": dict(t=5, e=6, k=3, h=40, inter=24),
    "top_k_is_all_experts": dict(t=3, e=4, k=4, h=32, inter=16),
    "several_blocks_per_expert": dict(t=40, e=4, k=2, h=32, inter=48),
}


@pytest.mark.parametrize("case", list(CASES))
def test_triton_matches_torch(case: str) -> None:
    x, w13, w2, weights, ids = make(**CASES[case], seed=len(case))
    ref = experts_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(ref.double(), per_token_reference(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)
    got = experts_triton(*(a.to(DEV) for a in (x, w13, w2, weights, ids)))
    torch.testing.assert_close(got.cpu(), ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_triton_all_tokens_to_one_expert() -> None:
    ids = torch.full((5, 1), 3)
    x, w13, w2, weights, ids = make(5, 8, 1, 64, 32, seed=3, ids=ids)
    got = experts_triton(*(a.to(DEV) for a in (x, w13, w2, weights, ids)))
    torch.testing.assert_close(got.cpu(), experts_torch(x, w13, w2, weights, ids),
                               atol=2e-5, rtol=2e-5)


def test_triton_idle_experts_and_int32_ids() -> None:
    """Only experts 1 and 6 get tokens; the other six must be skipped cleanly."""
    ids = torch.tensor([[1, 6], [6, 1]] * 3, dtype=torch.int32)
    x, w13, w2, weights, _ = make(6, 8, 2, 64, 32, seed=4, ids=ids)
    got = experts_triton(*(a.to(DEV) for a in (x, w13, w2, weights, ids)))
    torch.testing.assert_close(got.cpu(), experts_torch(x, w13, w2, weights, ids.long()),
                               atol=2e-5, rtol=2e-5)


BF16_DOT = pytest.mark.skipif(INTERPRET, reason="the interpreter's tl.dot does not support "
                              "bf16 (triton-lang/triton#11584); runs on a GPU")


@pytest.mark.parametrize("path", ["grouped", "decode"])
@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=BF16_DOT), torch.float16])
def test_triton_half_precision(dtype: torch.dtype, path: str) -> None:
    """Both paths of a few half-precision tokens (the tuner's candidates: grouped GEMMs and
    half_decode_experts.py) against float32 torch."""
    x, w13, w2, weights, ids = make(6, 8, 2, 64, 32, seed=5)
    x, w13, w2, weights = (a.to(dtype) for a in (x, w13, w2, weights))
    ref = experts_torch(*(a.float() for a in (x, w13, w2, weights)), ids)
    got = experts_triton(*(a.to(DEV) for a in (x, w13, w2, weights, ids)), path=path)
    assert got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


def test_triton_no_tokens() -> None:
    x, w13, w2, weights, ids = make(0, 4, 2, 32, 16, seed=6)
    out = experts_triton(*(a.to(DEV) for a in (x, w13, w2, weights, ids)))
    assert out.shape == (0, 32)


def test_triton_rejects_bad_inputs() -> None:
    x, w13, w2, weights, ids = make(2, 4, 2, 32, 16, seed=7)
    with pytest.raises(ValueError, match="do not fit"):
        experts_triton(x, w13, w2[:, :, :8], weights, ids)
    with pytest.raises(ValueError, match="k]"):
        experts_triton(x, w13, w2, weights[:1], ids[:1])
    with pytest.raises(ValueError, match="fp16/bf16/fp32"):
        experts_triton(x, w13.double(), w2, weights, ids)
    with pytest.raises(ValueError, match="contiguous"):
        experts_triton(x, w13.transpose(1, 2).contiguous().transpose(1, 2), w2, weights, ids)


def test_choose_tiles() -> None:
    assert choose_tiles(8, 128, torch.bfloat16) == (16, 64, 64)  # decode: a row per expert
    assert choose_tiles(8192 * 8, 128, torch.bfloat16)[0] == 64  # long prefill
    assert choose_tiles(4, 8, torch.float32) == (16, 32, 32)


# ---- router, dense fallback, loader ------------------------------------------------------


@pytest.mark.parametrize("renormalize", [True, False])
def test_select_experts(renormalize: bool) -> None:
    logits = torch.randn(5, 8, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    weights, ids = select_experts(logits, 3, renormalize)
    probs = torch.softmax(logits.float(), -1)
    want_w, want_ids = probs.topk(3, -1)
    if renormalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    assert torch.equal(ids, want_ids)
    assert weights.dtype == torch.bfloat16 and torch.equal(weights, want_w.to(torch.bfloat16))


def test_dense_fallback_matches_routed_loop() -> None:
    x, w13, w2, weights, ids = make(6, 8, 2, 32, 16, seed=9)
    torch.testing.assert_close(experts_dense(x, w13, w2, weights, ids),
                               experts_torch(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_fused_moe_loads_per_expert_tensors() -> None:
    """gate / up / down checkpoint tensors land in w13 (gate rows, then up) and w2."""
    x, w13, w2, weights, ids = make(4, 4, 2, 32, 16, seed=10)
    layer = FusedMoE(4, 32, 16)
    for e in range(4):
        gate, up = w13[e].chunk(2)
        layer.weight_loader(layer.w13_weight, up, e, "w3")
        layer.weight_loader(layer.w13_weight, gate, e, "w1")
        layer.weight_loader(layer.w2_weight, w2[e], e, "w2")
    assert torch.equal(layer.w13_weight, w13) and torch.equal(layer.w2_weight, w2)
    torch.testing.assert_close(layer(x, weights, ids),
                               per_token_reference(x, w13, w2, weights, ids).float(),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="shard_id"):
        layer.weight_loader(layer.w2_weight, w2[0], 0, "w4")
    with pytest.raises(ValueError, match="out of range"):
        layer.weight_loader(layer.w2_weight, w2[0], 4, "w2")
