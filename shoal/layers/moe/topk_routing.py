"""Softmax top-k routing of MoE tokens in one Triton launch: router logits [T, E] in, expert
ids [T, k] (int64) and weights [T, k] (the logits' dtype) out.

Two orders, each the torch code it replaces (shoal/layers/moe/router.py):
- "softmax_then_topk" (select_experts; Qwen3-MoE, Qwen3-Next, Mixtral): softmax in float32 over
  all E experts, the k largest probabilities, optionally rescaled to sum to one, rounded to
  the logits' dtype once at the end.
- "topk_then_softmax" (topk_then_softmax; GPT-OSS): the k largest logits, then a softmax over
  those k in float32 rounded once to the logits' dtype, which is what torch.softmax(top,
  dtype=top.dtype) computes for a bf16 / fp16 `top` (it upcasts, and rounds the result once).

One program takes ROWS token rows (one for decode-sized T). Each pick is a single max over
64-bit keys: the value's bits made order-preserving as a signed int in the high word, the
expert's index reversed in the low word, so the largest value wins and, among equal values,
the lowest expert index. torch.topk leaves the order of equal values unspecified, so on exact
ties the ids may differ from torch's (the set of picked values does not); random real logits
rarely tie. -0.0 counts as +0.0. NaN logits are not supported (the outputs are unspecified).

Rounding: the differences, the divisions (div_rn, correctly rounded as CUDA's `/` in torch's
kernels; Triton's `/` is an approximate division) and the max are exactly torch's operations.
exp on the GPU is libdevice's expf (an fma range reduction, ex2.approx of the remainder, times
2^j: CUDA's accurate expf, which torch's softmax kernels call, so expected equal to torch's
exp; not yet compared on a GPU), linked without flush-to-zero as torch's kernels are
(enable_reflect_ftz=False: Triton's default would flush subnormal probabilities to 0). tl.exp
would be ex2.approx of x * log2(e), tens of ulps off at |x| ~ 20. The sums add in another
order than torch's reductions. So the float32 weights before the final rounding are expected
within a couple of float32 ulps of torch's (a final bf16 / fp16 rounding then lands on torch's
value or, rarely, one ulp beside it); the tests allow 4 on the GPU.
Under TRITON_INTERPRET=1 exp is numpy's (libdevice does not run there), within 2 ulps of
torch's CPU exp (whose softmax multiplies by 1 / sum): the interpreted weights are within 6
float32 ulps of torch's CPU ones (measured; the tests allow 8). The bf16 rounding goes through
interpreted_half.to_dtype there (the interpreter's own truncates)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from shoal.attention.ops.interpreted_half import to_dtype

RoutingOrder = Literal["softmax_then_topk", "topk_then_softmax"]
ORDERS: tuple[str, ...] = ("softmax_then_topk", "topk_then_softmax")
MAX_EXPERTS = 1024  # the most experts one row's block holds (Qwen3-Next has 512)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_REMOVED = tl.constexpr(-(2 ** 63))  # the key of a padding column or of an expert already picked


@triton.jit
def _exp(x, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        y = tl.exp(x)
    else:
        y = libdevice.exp(x)
    return y


@triton.jit
def _ordered_bits(v):
    """float32 -> int32 whose signed order is the floats' order (+0.0 and -0.0 one value):
    negative floats' magnitude bits flipped. _from_ordered_bits undoes it."""
    bits = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _from_ordered_bits(key):
    return (key ^ ((key >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def route_rows(x, col_ok, TOP_K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
               RENORMALIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
               BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
               BITONIC: tl.constexpr = False):
    """The routing of ROWS rows of float32 logits x [ROWS, BLOCK_E] (padding columns, where
    col_ok is false, hold -inf) -> (float32 weights, int64 ids), both [ROWS, BLOCK_K], largest
    first; slots past TOP_K are unspecified. Shared with gate_routing.py's fused launch.
    The picks: TOP_K maxima one after another, or (BITONIC, k > 1) Triton's bitonic
    top-BLOCK_K of the keys, the same picks in the same order (the keys are distinct) in
    fewer dependent steps across a row's lanes. (k = 1 is one maximum either way, and some
    Tritons' tl.topk fail at k = 1.)"""
    cols = tl.arange(0, BLOCK_E)
    if SOFTMAX_FIRST:  # the picks are among the probabilities, as torch picks them
        e = _exp(x - tl.max(x, axis=1)[:, None], INTERPRETED)
        x = tl.div_rn(e, tl.sum(e, axis=1)[:, None])
    key = (_ordered_bits(x).to(tl.int64) << 32) | (BLOCK_E - 1 - cols)[None, :]
    key = tl.where(col_ok[None, :], key, _REMOVED)

    slots = tl.arange(0, BLOCK_K)[None, :]
    if BITONIC and BLOCK_K > 1:
        best = tl.topk(key, BLOCK_K)  # [ROWS, BLOCK_K], largest first
        picked = slots < TOP_K
        ids = tl.where(picked, BLOCK_E - 1 - (best & (BLOCK_E - 1)), 0)
        vals = tl.where(picked, _from_ordered_bits((best >> 32).to(tl.int32)), float("-inf"))
    else:
        ids = tl.zeros([ROWS, BLOCK_K], dtype=tl.int64)
        vals = tl.full([ROWS, BLOCK_K], float("-inf"), tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.max(key, axis=1)
            idx = BLOCK_E - 1 - (best & (BLOCK_E - 1))
            val = _from_ordered_bits((best >> 32).to(tl.int32))
            ids = tl.where(slots == j, idx[:, None], ids)
            vals = tl.where(slots == j, val[:, None], vals)
            key = tl.where(cols[None, :] == idx[:, None], _REMOVED, key)

    if SOFTMAX_FIRST:
        w = vals
        if RENORMALIZE:
            w = tl.div_rn(w, tl.sum(tl.where(slots < TOP_K, w, 0.0), axis=1)[:, None])
    else:  # vals[:, 0] is the largest; the unused slots hold -inf: exp gives 0
        e = _exp(vals - tl.max(vals, axis=1)[:, None], INTERPRETED)
        w = tl.div_rn(e, tl.sum(e, axis=1)[:, None])
    return w, ids


@triton.jit
def store_routes(w, ids, rows, row_ok, weights_ptr, ids_ptr, TOP_K: tl.constexpr,
                 BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
    """route_rows' outputs of `rows` (where row_ok) into weights [T, TOP_K] (rounded once to
    their dtype) and ids [T, TOP_K]."""
    slots = tl.arange(0, BLOCK_K)[None, :]
    out = rows[:, None] * TOP_K + slots
    out_ok = row_ok[:, None] & (slots < TOP_K)
    w = to_dtype(w, weights_ptr.dtype.element_ty, INTERPRETED)
    tl.store(weights_ptr + out, w, mask=out_ok)
    tl.store(ids_ptr + out, ids, mask=out_ok)


@triton.jit(do_not_specialize=["n_rows"])  # one binary for T = 1, 7, 64, ... of a shape
def _topk_routing_kernel(
    logits_ptr, weights_ptr, ids_ptr, n_rows, stride_row,
    N_EXPERTS: tl.constexpr, TOP_K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
    RENORMALIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < n_rows
    col_ok = cols < N_EXPERTS
    # rows past the end (of the last program) read the last row again: no -inf - -inf there
    src = tl.minimum(rows, n_rows - 1)
    x = tl.load(logits_ptr + src[:, None] * stride_row + cols[None, :], mask=col_ok[None, :],
                other=float("-inf")).to(tl.float32)
    w, ids = route_rows(x, col_ok, TOP_K, SOFTMAX_FIRST, RENORMALIZE, ROWS, BLOCK_E, BLOCK_K,
                        INTERPRETED)
    store_routes(w, ids, rows, row_ok, weights_ptr, ids_ptr, TOP_K, BLOCK_K, INTERPRETED)


@dataclass(frozen=True)
class RoutingPlan:
    """A launch's fixed shape, a function of (T, E, k) only (so CUDA-graph captures of one
    batch size always replay the same launch)."""

    rows_per_program: int
    block_experts: int
    block_k: int
    num_warps: int

    def grid(self, num_tokens: int) -> tuple[int]:
        return (triton.cdiv(num_tokens, self.rows_per_program),)


def plan_routing(num_tokens: int, num_experts: int, top_k: int) -> RoutingPlan:
    """Decode-sized batches: a row a program (T programs run side by side, each a k-step
    chain of one-warp reductions). Longer ones pack rows up to 256 keys a program, so a
    prefill of thousands of tokens is not thousands of tiny programs."""
    block_e = triton.next_power_of_2(num_experts)
    rows = 1 if num_tokens < 256 else max(1, min(8, 256 // block_e))
    return RoutingPlan(rows, block_e, triton.next_power_of_2(top_k),
                       max(1, min(4, rows * block_e // 256)))


def fits_kernel(logits: torch.Tensor, top_k: int) -> bool:
    """Whether the kernel takes these logits (else the caller keeps its torch code)."""
    return (logits.dim() == 2 and logits.dtype in DTYPES
            and 1 <= top_k <= logits.shape[1] <= MAX_EXPERTS)


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (tests on the CPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def topk_routing(logits: torch.Tensor, top_k: int, order: RoutingOrder,
                 renormalize: bool = False, plan: RoutingPlan | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [T, E] float32 / bf16 / fp16 (rows may be strided) -> (weights [T, k] in the
    logits' dtype, expert ids int64 [T, k]), largest first. `renormalize` is for
    softmax_then_topk only (topk_then_softmax's weights already sum to one). No host
    synchronization; any T, 0 included. `plan` overrides plan_routing (tests, tuning)."""
    if order not in ORDERS:
        raise ValueError(f"order {order!r} must be one of {ORDERS}")
    if renormalize and order != "softmax_then_topk":
        raise ValueError("renormalize applies to order 'softmax_then_topk' only")
    if logits.dim() != 2 or logits.dtype not in DTYPES:
        raise ValueError(f"logits must be [T, E] in {DTYPES}, got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    t, e = logits.shape
    if not 1 <= e <= MAX_EXPERTS:
        raise ValueError(f"num_experts {e} must be in [1, {MAX_EXPERTS}]")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k {top_k} must be in [1, num_experts={e}]")
    weights = torch.empty(t, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    plan = plan or plan_routing(t, e, top_k)
    _topk_routing_kernel[plan.grid(t)](
        logits, weights, ids, t, logits.stride(0),
        N_EXPERTS=e, TOP_K=top_k, SOFTMAX_FIRST=order == "softmax_then_topk",
        RENORMALIZE=renormalize, ROWS=plan.rows_per_program, BLOCK_E=plan.block_experts,
        BLOCK_K=plan.block_k, INTERPRETED=interpreted(), num_warps=plan.num_warps,
        enable_reflect_ftz=False)
    return weights, ids
