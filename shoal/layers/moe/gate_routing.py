"""A softmax top-k router at decode sizes in one Triton launch: the gate's logits x @ W^T (+ b)
and the routing of every token (topk_routing.py's math), for T <= MAX_TOKENS tokens.

The unfused pair is F.linear (cuBLAS's GEMV: latency-bound, ~5 us for Qwen3.5-35B-A3B's 1 MB
256 x 2048 bf16 gate on an H100) and the routing kernel (~3 us), two launches a MoE layer.
Here a grid of programs each computes BLOCK_E experts' logits for all the tokens, as
gate_logits.py does for DeepSeek's float32 logits except that a program reads its weight rows
once for every token (the tokens' partial sums are reduced per H chunk). A logit is rounded to
the activations' dtype, the dtype F.linear gives (and, with a bias, after adding it, as
cuBLAS's epilogue does), and written as float32 to a scratch [MAX_TOKENS, E]: the routing
then reads the values the unfused path routes, up to the order of the GEMV's sums. The program
that finishes last (a counter, atomic with acq_rel: every program's logits are written
before it counts) routes every token, then resets the counter for the next launch, as
int4_wide_gemv.py's K split has its strip's last program add the partials.

Scratch and counter are one pair per (device, E), made at the first eager call and reused by
every later call and CUDA-graph replay. Launches share them, so they must not overlap: shoal
runs a model's layers in one stream. The summation order differs from cuBLAS's, so the ids
equal the unfused path's except where two logits lie within a rounding of each other at the
k-th place (as between two GEMM libraries)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shoal import pdl
from shoal.attention.ops.interpreted_half import to_dtype
from shoal.layers.moe.gate_logits import MAX_TOKENS, fits_gate_kernel
from shoal.layers.moe.topk_routing import (
    MAX_EXPERTS,
    ORDERS,
    RoutingOrder,
    interpreted,
    route_rows,
    store_routes,
)

HAVE_TOPK = hasattr(tl, "topk")  # Triton's bitonic top-k (not in every version)

__all__ = ["MAX_TOKENS", "GateRoutingPlan", "fits_fused", "gate_routing", "plan_gate_routing"]


@triton.jit
def _weight_chunk(w_ptr, experts, e_ok, stride_we, h0, hidden, BLOCK_H: tl.constexpr):
    """float32 [BLOCK_E, BLOCK_H]: the experts' weight columns h0 .. h0 + BLOCK_H."""
    offs = h0 + tl.arange(0, BLOCK_H)
    return tl.load(w_ptr + experts[:, None].to(tl.int64) * stride_we + offs[None, :],
                   mask=e_ok[:, None] & (offs < hidden)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _add_chunk(acc, w, x_ptr, stride_xt, rows, h0, hidden, N_TOKENS: tl.constexpr,
               BLOCK_H: tl.constexpr):
    """acc [ROWS, BLOCK_E] + every token's partial sums over the chunk's columns (the weight
    tile serves every token)."""
    offs = h0 + tl.arange(0, BLOCK_H)
    for t in tl.static_range(N_TOKENS):
        x = tl.load(x_ptr + t * stride_xt + offs, mask=offs < hidden, other=0.0).to(tl.float32)
        part = tl.sum(w * x[None, :], axis=1)
        acc = tl.where(rows[:, None] == t, acc + part[None, :], acc)
    return acc


@triton.jit
def _gate_routing_kernel(
    x_ptr, w_ptr, b_ptr, logits_ptr, weights_ptr, ids_ptr, count_ptr, stride_xt, stride_we,
    hidden, N_TOKENS: tl.constexpr, N_EXPERTS: tl.constexpr, HAS_BIAS: tl.constexpr,
    TOP_K: tl.constexpr, SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, ROUTE_E: tl.constexpr,
    BLOCK_K: tl.constexpr, BITONIC: tl.constexpr, INTERPRETED: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.launch_next(PDL)
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = experts < N_EXPERTS
    rows = tl.arange(0, ROWS)
    acc = tl.zeros([ROWS, BLOCK_E], dtype=tl.float32)
    # the first H chunk's weights load before the wait (weights are no step's output,
    # shoal/pdl.py): at H <= BLOCK_H, the whole tile, read in the tail of the kernel before
    # (not named w: the routing below binds w to other shapes, which Triton refuses)
    tile = _weight_chunk(w_ptr, experts, e_ok, stride_we, 0, hidden, BLOCK_H)
    pdl.wait_previous(PDL)
    acc = _add_chunk(acc, tile, x_ptr, stride_xt, rows, 0, hidden, N_TOKENS, BLOCK_H)
    for h0 in range(BLOCK_H, hidden, BLOCK_H):
        tile = _weight_chunk(w_ptr, experts, e_ok, stride_we, h0, hidden, BLOCK_H)
        acc = _add_chunk(acc, tile, x_ptr, stride_xt, rows, h0, hidden, N_TOKENS, BLOCK_H)
    if HAS_BIAS:
        acc += tl.load(b_ptr + experts, mask=e_ok, other=0.0).to(tl.float32)[None, :]
    # F.linear's output dtype, held as float32
    logits = to_dtype(acc, x_ptr.dtype.element_ty, INTERPRETED).to(tl.float32)
    tl.store(logits_ptr + rows[:, None] * N_EXPERTS + experts[None, :], logits,
             mask=(rows < N_TOKENS)[:, None] & e_ok[None, :])
    tl.debug_barrier()  # every thread's logits are written before the count goes up
    if tl.atomic_add(count_ptr, 1, sem="acq_rel") == tl.num_programs(0) - 1:
        cols = tl.arange(0, ROUTE_E)
        col_ok = cols < N_EXPERTS
        src = tl.minimum(rows, N_TOKENS - 1)  # padding rows route the last token again
        # .cg: read at L2, where the other programs wrote them (not a stale line of this L1)
        x = tl.load(logits_ptr + src[:, None] * N_EXPERTS + cols[None, :],
                    mask=col_ok[None, :], other=float("-inf"), cache_modifier=".cg")
        w, ids = route_rows(x, col_ok, TOP_K, SOFTMAX_FIRST, RENORMALIZE, ROWS, ROUTE_E,
                            BLOCK_K, INTERPRETED, BITONIC)
        store_routes(w, ids, rows, rows < N_TOKENS, weights_ptr, ids_ptr, TOP_K, BLOCK_K,
                     INTERPRETED)
        tl.store(count_ptr, 0)  # ready for the next launch (and graph replay)


@dataclass(frozen=True)
class GateRoutingPlan:
    """A launch's fixed shape, a function of (T, E, H, k) only."""

    experts_per_program: int  # BLOCK_E: the grid is ceil(E / BLOCK_E) programs
    block_hidden: int  # BLOCK_H: the H chunk a program loads at once
    num_warps: int
    bitonic: bool = False  # the last program's picks: Triton's bitonic top-k (route_rows),
    # else TOP_K maxima one after another

    def grid(self, num_experts: int) -> tuple[int]:
        return (triton.cdiv(num_experts, self.experts_per_program),)


def plan_gate_routing(num_tokens: int, num_experts: int, hidden: int) -> GateRoutingPlan:
    """Warps as topk_routing.plan_routing gives a row-a-program launch (one for a token of
    <= 256 experts: the last program's k-step chain of maxima stays in one warp's shuffles,
    no shared-memory round trip a step), up to 8 for [pow2(T), pow2(E)] keys past 256 a
    warp. One expert a program (two or four past 256 experts: at most 256 programs), so
    the weight read is spread over the SMs; a program's weight tile at most 64 values a
    thread, every load of a chunk in flight at once (H = 2048 is one chunk at one warp and
    one expert). The routing's k-step chain does not change it. The picks are bitonic
    (route_rows) where Triton has tl.topk: on an H100 in a CUDA graph, 4.33 -> 4.00 us at
    T = 1 (E 256, k 8), 5.84 -> 5.12 at T = 2, 7.19 -> 6.01 at T = 4, 9.25 -> 8.76 at T = 8,
    6.62 -> 6.32 at Qwen3-Next's E 512, k 10 (2026-12-07)."""
    keys = triton.next_power_of_2(num_tokens) * triton.next_power_of_2(num_experts)
    warps = max(1, min(8, keys // 256))
    block_e = max(1, triton.next_power_of_2(num_experts) // 256)
    block_h = min(triton.next_power_of_2(hidden), 64 * 32 * warps // block_e)
    return GateRoutingPlan(block_e, block_h, warps, bitonic=HAVE_TOPK)


def fits_fused(x: torch.Tensor, weight: torch.Tensor, top_k: int,
               bias: torch.Tensor | None = None) -> bool:
    """Whether the fused launch takes this router call: x [T <= MAX_TOKENS, H] and weight
    [E <= MAX_EXPERTS, H] contiguous along H in one dtype (that of F.linear's logits), a bias
    [E] of it or none (else the caller keeps F.linear and the routing kernel)."""
    return (fits_gate_kernel(x, weight) and weight.dtype == x.dtype
            and 1 <= top_k <= weight.shape[0] <= MAX_EXPERTS
            and (bias is None or (bias.dtype == x.dtype and bias.shape == weight.shape[:1]
                                  and bias.stride(0) == 1)))


@dataclass
class _Scratch:
    logits: torch.Tensor  # float32 [MAX_TOKENS, E]: written and read inside one launch
    count: torch.Tensor  # int32 [1]: zero between launches (the last program resets it)


_SCRATCH: dict[tuple[torch.device, int], _Scratch] = {}


def scratch_ready(device: torch.device, num_experts: int) -> bool:
    """Whether a call may run here now: its scratch exists, or it can be made (not inside a
    CUDA-graph capture, whose allocations would live in the graph's pool)."""
    return ((device, num_experts) in _SCRATCH or device.type != "cuda"
            or not torch.cuda.is_current_stream_capturing())


def _scratch(device: torch.device, num_experts: int) -> _Scratch:
    key = (device, num_experts)
    have = _SCRATCH.get(key)
    if have is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("gate_routing: run it once outside CUDA-graph capture first "
                               f"(its scratch for {num_experts} experts is made then)")
        have = _SCRATCH[key] = _Scratch(
            torch.empty(MAX_TOKENS, num_experts, dtype=torch.float32, device=device),
            torch.zeros(1, dtype=torch.int32, device=device))
    return have


def gate_routing(x: torch.Tensor, weight: torch.Tensor, top_k: int, order: RoutingOrder,
                 renormalize: bool = False, bias: torch.Tensor | None = None,
                 plan: GateRoutingPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] (1 <= T <= MAX_TOKENS), weight [E, H], bias [E] or None, all one dtype ->
    (weights [T, k] in that dtype, expert ids int64 [T, k]), largest first: what
    topk_routing(F.linear(x, weight, bias), top_k, order, renormalize) gives, in one launch.
    No host synchronization. `plan` overrides plan_gate_routing (tests, tuning)."""
    if order not in ORDERS:
        raise ValueError(f"order {order!r} must be one of {ORDERS}")
    if renormalize and order != "softmax_then_topk":
        raise ValueError("renormalize applies to order 'softmax_then_topk' only")
    if not fits_fused(x, weight, top_k, bias):
        raise ValueError(
            f"gate_routing takes x [1..{MAX_TOKENS}, H], weight [E, H] with 1 <= top_k <= E "
            f"<= {MAX_EXPERTS}, contiguous along H, and a bias [E] or none, all one of fp32 / "
            f"bf16 / fp16; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} "
            f"{weight.dtype}, top_k {top_k}, bias "
            f"{None if bias is None else (tuple(bias.shape), bias.dtype)}")
    t, hidden = x.shape
    e = weight.shape[0]
    plan = plan or plan_gate_routing(t, e, hidden)
    scratch = _scratch(x.device, e)
    weights = torch.empty(t, top_k, dtype=x.dtype, device=x.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    _gate_routing_kernel[plan.grid(e)](
        x, weight, weight if bias is None else bias, scratch.logits, weights, ids,
        scratch.count, x.stride(0), weight.stride(0), hidden,
        N_TOKENS=t, N_EXPERTS=e, HAS_BIAS=bias is not None, TOP_K=top_k,
        SOFTMAX_FIRST=order == "softmax_then_topk", RENORMALIZE=renormalize,
        ROWS=triton.next_power_of_2(t), BLOCK_E=plan.experts_per_program,
        BLOCK_H=plan.block_hidden, ROUTE_E=triton.next_power_of_2(e),
        BLOCK_K=triton.next_power_of_2(top_k), BITONIC=plan.bitonic, INTERPRETED=interpreted(),
        num_warps=plan.num_warps, enable_reflect_ftz=False, **pdl.kwargs(x.device))
    return weights, ids
