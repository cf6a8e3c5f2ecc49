"""DeepSeek-V2 / V3 expert routing in one Triton launch: float32 router logits [T, E] in,
expert ids [T, k] (int64) and weights [T, k] out, the computation of route_v2 / route_v3
(shoal/layers/moe/deepseek_router.py), which is 5 to 12 small torch kernels a layer.

Methods (each as the torch code it replaces):
- "greedy" (V2-Lite): softmax over all E experts, the k largest probabilities, times
  routed_scaling_factor.
- "group_limited_greedy" (V2): the same among the experts of the topk_group groups whose best
  probability is highest; the other experts' probabilities become 0 as torch masks them.
- "noaux_tc" (V3, Kimi-K2, GLM-4.5): sigmoid scores; choice = score + e_score_correction_bias;
  a group scores the sum of its two best choices, topk_group groups are kept, the other
  experts' choices become -inf; the k largest choices are picked; their weights are their
  unbiased scores, optionally divided by (their sum + 1e-20), times routed_scaling_factor.
With topk_group == n_group (or greedy) there is no group step, as in torch.

One program takes ROWS token rows, each held as a [groups, group size] tile (groups padded to a
power of two, each group's experts too: V2's groups of 20 sit in 32 columns), so a group's
best and second best are one reduction along the tile's last axis for all groups at once.
Every pick, of a group or an expert, is the max of 64-bit keys as in topk_routing.py (its
_ordered_bits: the largest value wins and, among equal values, the lowest index; torch leaves
the order of equal values unspecified, so on exact ties the ids may differ from torch's, and
where the last group kept ties the next one torch may keep the other, and so pick other
values). The k picks are written largest first (by probability for V2, by
the biased choice for V3), where torch.topk(sorted=False) leaves its order unspecified; the MoE
layer only sums over the k slots, so the order changes at most the rounding of that sum.

Rounding: exp is topk_routing's (libdevice expf on the GPU, linked without flush-to-zero;
numpy's when interpreted) and divisions are correctly rounded (div_rn, CUDA's `/`). The
sigmoid is torch's CUDA formula 1 / (1 + exp(-x)). Triton's default fp fusion contracts expf's
last multiply with the `1 +` into one fma, as nvcc's default -fmad=true (torch's build) is
expected to in torch's sigmoid kernel; if both do, V3's choices, group scores and picks equal
torch's on the GPU and its unrenormalized weights are bit for bit (not yet compared on a GPU;
otherwise they are about an ulp apart). V2's softmax and V3's renormalizing sum add in another
order than torch's reductions (a couple of float32 ulps). Interpreted, numpy's exp against
torch's CPU exp and sigmoid puts the weights up to 6 float32 ulps from torch's CPU ones
(measured; the tests allow 8, and 4 on the GPU). The weights are rounded once to out_dtype
(the router returns the activation dtype), as route_v2 / route_v3's float32 weights
.to(dtype) round them. NaN logits are not supported."""

from __future__ import annotations

import os
from typing import Literal

import torch
import triton
import triton.language as tl

from shoal.attention.ops.interpreted_half import to_dtype
from shoal.layers.moe.topk_routing import (
    _REMOVED,
    DTYPES,
    MAX_EXPERTS,
    RoutingPlan,
    _exp,
    _from_ordered_bits,
    _ordered_bits,
    plan_routing,
)

DeepseekMethod = Literal["greedy", "group_limited_greedy", "noaux_tc"]
METHODS: tuple[str, ...] = ("greedy", "group_limited_greedy", "noaux_tc")


@triton.jit
def _row_max(x):
    """[ROWS, G, S] -> [ROWS]."""
    return tl.max(tl.max(x, axis=2), axis=1)


@triton.jit
def _value(key):
    """The float a key was made of (its high word)."""
    return _from_ordered_bits((key >> 32).to(tl.int32))


@triton.jit
def _keys(v, low, valid):
    """Order-preserving 64-bit keys: v's bits high, `low` (a reversed index) low; invalid
    slots removed."""
    return tl.where(valid, (_ordered_bits(v).to(tl.int64) << 32) | low, _REMOVED)


@triton.jit
def _kept_groups(group_score, N_GROUPS: tl.constexpr, TOPK_GROUP: tl.constexpr,
                 BLOCK_G: tl.constexpr):
    """[ROWS, BLOCK_G] group scores -> [ROWS, BLOCK_G] bool: the TOPK_GROUP best groups of each
    row (equal scores: the lower group)."""
    grp = tl.arange(0, BLOCK_G)[None, :]
    gkey = _keys(group_score, BLOCK_G - 1 - grp, grp < N_GROUPS)
    kept = grp < 0
    for _ in tl.static_range(TOPK_GROUP):
        hit = gkey == tl.max(gkey, axis=1)[:, None]
        kept = kept | hit
        gkey = tl.where(hit, _REMOVED, gkey)
    return kept


@triton.jit
def _sigmoid(x, INTERPRETED: tl.constexpr):
    return tl.div_rn(tl.full(x.shape, 1.0, tl.float32), 1.0 + _exp(-x, INTERPRETED))


@triton.jit(do_not_specialize=["n_rows"])  # one binary for T = 1, 7, 64, ... of a config
def _deepseek_routing_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, n_rows, stride_row, scale,
    N_GROUPS: tl.constexpr, GROUP_SIZE: tl.constexpr, TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr, SIGMOID: tl.constexpr, GROUPED: tl.constexpr,
    RENORMALIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr,
):
    BLOCK_E: tl.constexpr = BLOCK_G * BLOCK_S  # a power of two above every expert index
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    grp = tl.arange(0, BLOCK_G)[None, :, None]
    expert = grp * GROUP_SIZE + tl.arange(0, BLOCK_S)[None, None, :]  # [1, G, S]
    valid = (grp < N_GROUPS) & (tl.arange(0, BLOCK_S)[None, None, :] < GROUP_SIZE)
    low = BLOCK_E - 1 - expert  # the keys' low word: the lower expert wins ties
    # rows past the end (of the last program) read the last row again
    src = tl.minimum(rows, n_rows - 1)
    x = tl.load(logits_ptr + src[:, None, None] * stride_row + expert, mask=valid,
                other=float("-inf"))
    if SIGMOID:
        choice = _sigmoid(x, INTERPRETED) + tl.load(bias_ptr + expert, mask=valid, other=0.0)
    else:
        e = _exp(x - _row_max(x)[:, None, None], INTERPRETED)
        choice = tl.div_rn(e, tl.sum(tl.sum(e, axis=2), axis=1)[:, None, None])
    if GROUPED:
        key = _keys(choice, low, valid)
        best = tl.max(key, axis=2)  # [ROWS, G]: each group's best expert
        if SIGMOID:  # plus its second best
            second = tl.max(tl.where(key == best[:, :, None], _REMOVED, key), axis=2)
            group_score = _value(best) + _value(second)
            fill = float("-inf")
        else:
            group_score = _value(best)
            fill = 0.0
        kept = _kept_groups(group_score, N_GROUPS, TOPK_GROUP, BLOCK_G)
        choice = tl.where(kept[:, :, None], choice, fill)  # torch's masked_fill
    key = _keys(choice, low, valid)

    slots = tl.arange(0, BLOCK_K)[None, :]
    ids = tl.zeros([ROWS, BLOCK_K], dtype=tl.int64)
    vals = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        best = _row_max(key)
        idx = BLOCK_E - 1 - (best & (BLOCK_E - 1))
        ids = tl.where(slots == j, idx[:, None], ids)
        vals = tl.where(slots == j, _value(best)[:, None], vals)
        key = tl.where(expert == idx[:, None, None], _REMOVED, key)

    out_ok = slots < TOP_K
    if SIGMOID:  # the unbiased scores of the picks: the same sigmoid of the same logits
        w = _sigmoid(tl.load(logits_ptr + src[:, None] * stride_row + ids, mask=out_ok,
                             other=0.0), INTERPRETED)
        if RENORMALIZE:
            w = tl.div_rn(w, tl.sum(tl.where(out_ok, w, 0.0), axis=1)[:, None] + 1e-20)
    else:
        w = vals
    w = to_dtype(w * scale, weights_ptr.dtype.element_ty, INTERPRETED)
    out = rows[:, None] * TOP_K + slots
    out_ok = (rows < n_rows)[:, None] & out_ok
    tl.store(weights_ptr + out, w, mask=out_ok)
    tl.store(ids_ptr + out, ids, mask=out_ok)


def _layout(num_experts: int, top_k: int, method: str, n_group: int, topk_group: int,
            renormalize: bool, bias: torch.Tensor | None) -> int:
    """Checks the arguments as route_v2 / route_v3 need them; returns the groups of the tile
    (1 when there is no group step)."""
    if method not in METHODS:
        raise ValueError(f"method {method!r} must be one of {METHODS}")
    if not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts {num_experts} must be in [1, {MAX_EXPERTS}]")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
    sigmoid = method == "noaux_tc"
    if renormalize and not sigmoid:
        raise ValueError("renormalize applies to method 'noaux_tc' only (V2 never renormalizes)")
    if sigmoid and (bias is None or tuple(bias.shape) != (num_experts,)
                    or bias.dtype != torch.float32):
        raise ValueError(f"noaux_tc needs a float32 bias of shape ({num_experts},)")
    if method == "greedy" or topk_group >= n_group:
        if topk_group > n_group and method != "greedy":
            raise ValueError(f"topk_group {topk_group} must be in [1, n_group={n_group}]")
        return 1
    if topk_group < 1 or num_experts % n_group:
        raise ValueError(f"n_group {n_group} must divide num_experts {num_experts} and "
                         f"topk_group {topk_group} must be in [1, n_group]")
    size = num_experts // n_group
    if top_k > topk_group * size:
        raise ValueError(f"top_k {top_k} exceeds the {topk_group * size} experts of the "
                         f"topk_group={topk_group} groups kept")
    if sigmoid and size < 2:
        raise ValueError("noaux_tc scores a group by its two best experts: each group needs 2")
    return n_group


def deepseek_routing(logits: torch.Tensor, top_k: int, method: DeepseekMethod,
                     n_group: int = 1, topk_group: int = 1, renormalize: bool = False,
                     routed_scaling_factor: float = 1.0, bias: torch.Tensor | None = None,
                     out_dtype: torch.dtype = torch.float32, plan: RoutingPlan | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: float32 [T, E] (rows may be strided) -> (weights [T, k] in out_dtype, expert
    ids int64 [T, k]), largest first; route_v2 (greedy, group_limited_greedy) or route_v3
    (noaux_tc, with its float32 bias [E]) in one launch. No host synchronization; any T, 0
    included. `plan` overrides plan_routing's rows a program, block_k and warps (tests,
    tuning)."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"logits must be float32 [T, E], got {tuple(logits.shape)} "
                         f"{logits.dtype}")
    if out_dtype not in DTYPES:
        raise ValueError(f"out_dtype {out_dtype} must be one of {DTYPES}")
    t, e = logits.shape
    groups = _layout(e, top_k, method, n_group, topk_group, renormalize, bias)
    weights = torch.empty(t, top_k, dtype=out_dtype, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int64, device=logits.device)
    if t == 0:
        return weights, ids
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    block_g = triton.next_power_of_2(groups)
    block_s = triton.next_power_of_2(e // groups)
    plan = plan or plan_routing(t, block_g * block_s, top_k)
    sigmoid = method == "noaux_tc"
    _deepseek_routing_kernel[plan.grid(t)](
        logits, bias.contiguous() if sigmoid else logits, weights, ids, t, logits.stride(0),
        float(routed_scaling_factor), N_GROUPS=groups, GROUP_SIZE=e // groups,
        TOPK_GROUP=topk_group if groups > 1 else 1, TOP_K=top_k, SIGMOID=sigmoid,
        GROUPED=groups > 1, RENORMALIZE=renormalize, ROWS=plan.rows_per_program,
        BLOCK_G=block_g, BLOCK_S=block_s, BLOCK_K=plan.block_k,
        INTERPRETED=os.environ.get("TRITON_INTERPRET") == "1", num_warps=plan.num_warps,
        enable_reflect_ftz=False)
    return weights, ids
