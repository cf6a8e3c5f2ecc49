"""bf16 / fp16 experts at decode sizes (a few tokens): two weight-streaming kernels that read
each routed pair's expert straight from its token's routing, without the grouped path's sort
(the dense counterpart of mxfp4_decode_experts.py; float32 runs too, for the interpreter).

At batch 1 the grouped path (triton_experts.py) runs a MoE layer as about 35 launches:
align.group_by_expert's chain of small torch ops (~27), two GEMMs whose 16-row tiles hold one
real row, silu_and_mul and the sum over the k slots; inside a CUDA graph each costs
microseconds. Here two launches (three with a K split of down):

- gate_up: one program per (pair, BLOCK_N outputs of I): the pair's expert is read from
  topk_ids, its BLOCK_N gate rows of w13 and the matching up rows (gate rows, then up rows)
  stream together over all of H, and the bias and the activation (SiLU-and-mul or gpt-oss's
  clamped SwiGLU, mxfp4_decode_experts.store_gate_up_activation) are applied in registers:
  act [T * k, I] in x's dtype, gate and up rounded to x's dtype first as the grouped path
  stores them.
- down: one program per (token, BLOCK_N outputs of H, K split): each K step reads the step's
  inputs of all k routed experts of the token (the slots unrolled, so their loads are in
  flight together), each slot's partial sums times its routing weight; split 0 adds the down
  biases times the routing weights. One split writes the output in x's dtype; more write
  float32 partials [split, T, H] that half_gemv's split-summing kernel adds in split order
  (deterministic, no atomics).

A K step is half_gemv.py's layout: [VECS, rows, VEC] with each thread holding one 16-byte
vector of every row of its program (VEC = 8 halves), the lanes and warps along K (BLOCK_K =
8 x 32 x warps on a GPU), float32 products summed within the thread each step and across
the threads once at the end. Rows past the end re-read the last row (not stored), so only a
range's last, part-filled step is masked.

Shared experts (shared_experts.py: DeepSeek's n_shared_experts MLP of S = n_shared * I) ride
along as S / I more slots a token of weight 1: gate_up's grid gains T * S / I programs (pairs
past the routed ones: chunk j reads gate rows j * I.. and up rows S + j * I.. of the shared
gate_up, no bias) writing act rows after the routed pairs', and down adds each chunk's K step
(columns j * I.. of the shared down) after the routed slots', in that fixed order. The MLP's
own weights are read in place: nothing is stacked or copied.

A gated shared expert (Qwen3-Next, Qwen3.5-MoE: the MLP's output times sigmoid(x . g) per
token, g the [1, H] gate row) adds T gate programs to gate_up's grid after the shared ones
(one a token, at the first block of outputs; the rest exit at once): each streams its token's
x against g in a loop of its own (the routed programs' code is unchanged), rounds the logit
to x's dtype as the unfused gate linear does, and writes sigmoid of it, float32, to a [T]
buffer; down multiplies each shared chunk's K step by its token's value, as a routed slot's
by its routing weight.

Graph safety: grids and buffers follow from T, k, the shared chunks (and gate) and the tiles
only; the routing and the gate are read on the device."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shoal import pdl
from shoal.layers.moe.activation import SILU, ExpertActivation
from shoal.layers.moe.expert_inputs import check_expert_inputs
from shoal.layers.moe.mxfp4_decode_experts import MAX_TOKENS, store_gate_up_activation
from shoal.layers.moe.shared_experts import SharedExperts
from shoal.layers.ops.half_gemv import (
    SUM_BLOCK,
    VEC,
    k_per_split,
    split_for,
    sum_splits_kernel,  # (split order)
)


@dataclass(frozen=True)
class HalfDecodeTiles:
    """gate_up: block_n outputs of I (and their up rows) a program; down: down_block_n
    outputs of H a program, K cut into `split` ranges; both step block_k inputs at a time
    (a power of two >= VEC; on a GPU 256 x num_warps: one 16-byte vector a thread)."""

    block_n: int
    down_block_n: int
    block_k: int
    split: int
    num_warps: int = 4

    def __post_init__(self) -> None:
        for name in ("block_n", "down_block_n", "block_k", "num_warps"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"HalfDecodeTiles.{name} must be a power of two, got {v}")
        if self.block_k < VEC:
            raise ValueError(f"HalfDecodeTiles.block_k must be >= {VEC}, got {self.block_k}")
        if not 1 <= self.split <= 64:
            raise ValueError(f"HalfDecodeTiles.split must be in [1, 64], got {self.split}")

    @property
    def name(self) -> str:
        return (f"half decode n{self.block_n} down n{self.down_block_n} k{self.block_k} "
                f"s{self.split} w{self.num_warps}")


@triton.jit
def _step_dots(w_step, x_step, offs_k, k0, k_end, MASKED: tl.constexpr):
    """[VECS, R] float32: per thread vector and row, the step's 8 products of w_step [VECS,
    R, VEC] and x_step [VECS, 1, VEC] (pointers at input 0) at inputs k0 + offs_k, summed.
    MASKED: inputs at or past k_end read 0 (a range's last, part-filled step)."""
    if MASKED:
        ok = (k0 + offs_k < k_end)[:, None, :]
        w = tl.load(w_step + k0, mask=ok, other=0.0)
        x = tl.load(x_step + k0, mask=ok, other=0.0)
    else:
        w = tl.load(w_step + k0)
        x = tl.load(x_step + k0)
    return tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=2)  # (VEC: within a thread)


@triton.jit
def _store_shared_weight(x_ptr, g_ptr, sw_ptr, token, k_in, stride_xm, BLOCK_K: tl.constexpr,
                         VEC: tl.constexpr):
    """sw[token] = sigmoid(x[token] . g[0, :]) in float32, the logit rounded to x's dtype
    first (as the unfused gate linear stores it)."""
    VECS: tl.constexpr = BLOCK_K // VEC
    offs_k = tl.arange(0, VECS)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [VECS, VEC]
    x_row = x_ptr + token.to(tl.int64) * stride_xm
    acc = tl.zeros([VECS, VEC], dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):  # (one program a token: every step masked)
        ok = k0 + offs_k < k_in
        g = tl.load(g_ptr + k0 + offs_k, mask=ok, other=0.0)
        acc += g.to(tl.float32) * tl.load(x_row + k0 + offs_k, mask=ok, other=0.0).to(tl.float32)
    logit = tl.sum(tl.sum(acc, axis=1), axis=0).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(sw_ptr + token, 1.0 / (1.0 + tl.exp(-logit)))


@triton.jit(do_not_specialize=["t_rows"])
def _gate_up_kernel(x_ptr, ids_ptr, w_ptr, bias_ptr, ws_ptr, g_ptr, out_ptr, sw_ptr, inter,
                    k_in, t_rows, stride_xm, stride_we, stride_wn, stride_bias, stride_sn,
                    stride_om, alpha, limit, TOPK: tl.constexpr, SHARED: tl.constexpr,
                    GATED: tl.constexpr, HAS_BIAS: tl.constexpr, CLAMPED: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
                    PDL: tl.constexpr = False):
    """act[pair, n] = activation(gate, up) for outputs n of this program's block, gate / up
    = the pair's token row of x . w13[expert, n (gate) / inter + n (up), :] (+ bias). Pairs
    past the T * TOPK routed ones are the shared chunks, token by token: chunk j of a token
    reads rows j * inter + n (gate) and SHARED * inter + j * inter + n (up) of ws [2 *
    SHARED * inter, H], no bias. GATED: T more pairs, token by token, write sw[token] =
    sigmoid(x[token] . g[0, :]) (float32; the logit rounded to x's dtype) from their first
    block of outputs."""
    pdl.grid_dependency(PDL)
    VECS: tl.constexpr = BLOCK_K // VEC
    pair = tl.program_id(0)
    n_routed = t_rows * TOPK
    if GATED:  # the gate programs: one a token computes its weight, the others exit
        gate_first = n_routed + t_rows * SHARED
        if pair >= gate_first:
            if tl.program_id(1) == 0:
                _store_shared_weight(x_ptr, g_ptr, sw_ptr, pair - gate_first, k_in,
                                     stride_xm, BLOCK_K, VEC)
            return
    # (a shared chunk's program reads a routed id it does not use: the last one)
    expert = tl.load(ids_ptr + tl.minimum(pair, n_routed - 1)).to(tl.int64)
    w_base = w_ptr + expert * stride_we
    row_stride = stride_wn
    up_rows = inter
    x_row = pair // TOPK
    if SHARED > 0:
        if pair >= n_routed:
            chunk = pair - n_routed
            x_row = chunk // SHARED
            w_base = ws_ptr + (chunk % SHARED).to(tl.int64) * inter * stride_sn
            row_stride = stride_sn
            up_rows = inter * SHARED
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    # rows [2 * BLOCK_N]: (gate n, up n) pairs, as store_gate_up_activation takes the sums;
    # rows past the end re-read the last one
    safe_n = tl.minimum(offs_n, inter - 1)
    rows = tl.reshape(safe_n[:, None] + tl.arange(0, 2)[None, :] * up_rows, (2 * BLOCK_N,))
    rows = rows.to(tl.int64)
    offs_k = tl.arange(0, VECS)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [VECS, VEC]
    w_step = w_base + rows[None, :, None] * row_stride + offs_k[:, None, :]
    x_step = x_ptr + x_row.to(tl.int64) * stride_xm + offs_k[:, None, :]
    k_full = k_in // BLOCK_K * BLOCK_K
    acc = tl.zeros([VECS, 2 * BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_full, BLOCK_K):
        acc += _step_dots(w_step, x_step, offs_k, k0, k_in, False)
    if k_full < k_in:
        acc += _step_dots(w_step, x_step, offs_k, k_full, k_in, True)
    sums = tl.sum(acc, axis=0)
    if HAS_BIAS:  # (a shared chunk's program reads the last routed pair's, adds none)
        routed_rows = tl.reshape(safe_n[:, None] + tl.arange(0, 2)[None, :] * inter,
                                 (2 * BLOCK_N,))
        bias = tl.load(bias_ptr + expert * stride_bias + routed_rows).to(tl.float32)
        sums += tl.where(pair < n_routed, bias, 0.0)
    store_gate_up_activation(sums, out_ptr + pair.to(tl.int64) * stride_om + offs_n, n_ok,
                             alpha, limit, BLOCK_N, CLAMPED)


@triton.jit
def _slots_step(acc, ids_ptr, r_ptr, w_rows, a_cols, offs_k, token, k0, k_end,
                stride_am, stride_we, TOPK: tl.constexpr, MASKED: tl.constexpr):
    """acc + one K step of every slot of the token (unrolled: all slots' loads in flight
    together), each slot's partial sums times its routing weight."""
    for slot in tl.static_range(TOPK):
        pair = token * TOPK + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        weight = tl.load(r_ptr + pair).to(tl.float32)
        acc += _step_dots(w_rows + expert * stride_we, a_cols + pair.to(tl.int64) * stride_am,
                          offs_k, k0, k_end, MASKED) * weight
    return acc


@triton.jit
def _shared_step(acc, ws_rows, a_cols, offs_k, first_row, k0, k_end, inter, stride_am,
                 weight, SHARED: tl.constexpr, GATED: tl.constexpr, MASKED: tl.constexpr):
    """acc + one K step of the token's SHARED shared chunks (act rows first_row + j, columns
    j * inter on of the shared down weight), weight 1 or (GATED) `weight`, after the routed
    slots."""
    for j in tl.static_range(SHARED):
        dots = _step_dots(ws_rows + j * inter, a_cols + (first_row + j).to(tl.int64) * stride_am,
                          offs_k, k0, k_end, MASKED)
        if GATED:
            dots = dots * weight
        acc += dots
    return acc


@triton.jit(do_not_specialize=["t_rows"])  # T changes with the batch: one compile
def _down_kernel(a_ptr, ids_ptr, r_ptr, w_ptr, bias_ptr, ws_ptr, sw_ptr, out_ptr, h_out,
                 k_in, k_span, t_rows, stride_am, stride_we, stride_wn, stride_bias,
                 stride_sn, TOPK: tl.constexpr, SHARED: tl.constexpr, GATED: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 VEC: tl.constexpr, PDL: tl.constexpr = False):
    """out[split, token, n] = sum over the token's k slots of routing weight * (act[pair, K
    range] . w2[expert, n, K range] (+ bias[expert, n] in split 0)), then its SHARED shared
    chunks' act[T * k + token * SHARED + j, K range] . ws[n, j * inter + K range] (ws [H,
    SHARED * inter]), times sw[token] (float32) if GATED; out is [T, H] in x's dtype with
    one split, else float32 partials [split, T, H]."""
    pdl.grid_dependency(PDL)
    VECS: tl.constexpr = BLOCK_K // VEC
    token, pid_k = tl.program_id(0), tl.program_id(2)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < h_out
    safe_n = tl.minimum(offs_n, h_out - 1).to(tl.int64)  # past the end: the last row again
    offs_k = tl.arange(0, VECS)[:, None] * VEC + tl.arange(0, VEC)[None, :]  # [VECS, VEC]
    w_rows = w_ptr + safe_n[None, :, None] * stride_wn + offs_k[:, None, :]  # (expert: + e)
    ws_rows = ws_ptr + safe_n[None, :, None] * stride_sn + offs_k[:, None, :]  # (chunk: + j I)
    a_cols = a_ptr + offs_k[:, None, :]  # (pair: + its row)
    first_shared = t_rows * TOPK + token * SHARED
    shared_weight = 1.0
    if GATED:
        shared_weight = tl.load(sw_ptr + token)
    k_start = pid_k * k_span
    k_end = tl.minimum(k_start + k_span, k_in)
    k_full = k_start + (k_end - k_start) // BLOCK_K * BLOCK_K
    acc = tl.zeros([VECS, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_full, BLOCK_K):
        acc = _slots_step(acc, ids_ptr, r_ptr, w_rows, a_cols, offs_k, token, k0,
                          k_end, stride_am, stride_we, TOPK, False)
        if SHARED > 0:
            acc = _shared_step(acc, ws_rows, a_cols, offs_k, first_shared, k0, k_end, k_in,
                               stride_am, shared_weight, SHARED, GATED, False)
    if k_full < k_end:
        acc = _slots_step(acc, ids_ptr, r_ptr, w_rows, a_cols, offs_k, token, k_full,
                          k_end, stride_am, stride_we, TOPK, True)
        if SHARED > 0:
            acc = _shared_step(acc, ws_rows, a_cols, offs_k, first_shared, k_full, k_end,
                               k_in, stride_am, shared_weight, SHARED, GATED, True)
    total = tl.sum(acc, axis=0)
    if HAS_BIAS:
        first = (pid_k == 0).to(tl.float32)
        for slot in tl.static_range(TOPK):
            pair = token * TOPK + slot
            expert = tl.load(ids_ptr + pair).to(tl.int64)
            bias = tl.load(bias_ptr + expert * stride_bias + safe_n).to(tl.float32)
            total += bias * (tl.load(r_ptr + pair).to(tl.float32) * first)
    dst = out_ptr + (pid_k.to(tl.int64) * t_rows + token) * h_out + offs_n
    tl.store(dst, total.to(out_ptr.dtype.element_ty), mask=n_ok)


# GPU tiles (gate_up block_n, down rows a slot, warps): a thread holds one 16-byte vector of
# each of its program's rows a step: gate_up 2 x block_n rows, down k x down_block_n (all
# slots of a step in flight), so down's rows follow k: ~16 and ~8 vectors a thread. The last
# two, ~32 vectors: at 9 slots (8 routed + a shared chunk: Qwen3.5-35B-A3B, I = 512) the
# others give down one output row a program, and the H200 ran its down at 0.47 of the copy
# bandwidth (9.5 us a layer, 2026-12-06); two rows a program, and one warp (its reduction
# stays in the warp). The tuner keeps them only where faster.
_GPU_TILES = ((4, 16, 4), (2, 8, 4), (8, 16, 2), (4, 32, 2), (2, 32, 1))


@functools.cache
def decode_tiles(tokens: int, top_k: int, h_out: int, inter: int, device: torch.device
                 ) -> tuple[HalfDecodeTiles, ...]:
    """Launch candidates for `tokens` rows of experts with H = h_out outputs, I = inter
    intermediate values and top_k slots, the heuristic's pick first: gpu_tiles for a GPU's
    multiprocessors; the interpreter gets one tile of few, large programs, down split in
    two so that both down paths run."""
    if device.type != "cuda":
        return (HalfDecodeTiles(32, 32, 32, 2, num_warps=1),)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return gpu_tiles(tokens, top_k, h_out, inter, sms)


def gpu_tiles(tokens: int, top_k: int, h_out: int, inter: int, sms: int
              ) -> tuple[HalfDecodeTiles, ...]:
    """_GPU_TILES, down's rows a program the largest power of two that keeps k x rows
    within the tile's vectors a thread, down split along I while its programs give fewer
    than half_gemv.PROGRAMS_PER_SM a multiprocessor of `sms` (half_gemv.split_for)."""
    out = []
    for block_n, slot_rows, warps in _GPU_TILES:
        down_n = 1 << (max(1, slot_rows // top_k).bit_length() - 1)
        block_k = 32 * VEC * warps
        split = split_for(tokens * h_out, inter, down_n, block_k, sms)
        out.append(HalfDecodeTiles(block_n, down_n, block_k, split, num_warps=warps))
    return tuple(dict.fromkeys(out))  # (k = 1: two tiles may coincide)


def run_half_decode(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    tiles: HalfDecodeTiles, w13_bias: torch.Tensor | None = None,
                    w2_bias: torch.Tensor | None = None,
                    activation: ExpertActivation = SILU,
                    shared: SharedExperts | None = None) -> torch.Tensor:
    """experts_half_decode without its checks (triton_experts.experts_triton checked the
    inputs and that `shared`, if given, fits: shared.chunks(x, I) > 0): the two or three
    launches."""
    t, k = topk_ids.shape
    e, two_i, h = w13.shape
    inter = two_i // 2
    chunks = 0 if shared is None else shared.chunks(x, inter)
    ws13 = shared.gate_up if chunks else w13  # (unread without chunks)
    ws2 = shared.down if chunks else w2
    gated = chunks > 0 and shared.gate is not None
    ids = topk_ids.contiguous()
    routing = topk_weights.contiguous()
    act = torch.empty(t * (k + chunks), inter, dtype=x.dtype, device=x.device)
    # the shared weight of each token (GATED), written by gate_up's gate programs
    sw = torch.empty(t if gated else 1, dtype=torch.float32, device=x.device)
    clamped = activation.kind == "clamped_swiglu"
    _gate_up_kernel[(t * (k + chunks + int(gated)), triton.cdiv(inter, tiles.block_n))](
        x, ids, w13, w13_bias if w13_bias is not None else x, ws13,
        shared.gate if gated else x, act, sw, inter, h, t,
        x.stride(0), w13.stride(0), w13.stride(1),
        w13_bias.stride(0) if w13_bias is not None else 0, ws13.stride(-2), act.stride(0),
        float(activation.alpha), float(activation.limit),
        TOPK=k, SHARED=chunks, GATED=gated, HAS_BIAS=w13_bias is not None,
        CLAMPED=clamped, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, VEC=VEC,
        num_warps=tiles.num_warps, **pdl.kwargs(x.device),
        num_stages=1)  # (Triton pipelines no load of a loop without tl.dot)
    span, split = k_per_split(inter, tiles.block_k, tiles.split)
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    part = out if split == 1 else torch.empty(split, t, h, dtype=torch.float32,
                                              device=x.device)
    _down_kernel[(t, triton.cdiv(h, tiles.down_block_n), split)](
        act, ids, routing, w2, w2_bias if w2_bias is not None else x, ws2, sw, part, h,
        inter, span, t, act.stride(0), w2.stride(0), w2.stride(1),
        w2_bias.stride(0) if w2_bias is not None else 0, ws2.stride(-2),
        TOPK=k, SHARED=chunks, GATED=gated, HAS_BIAS=w2_bias is not None,
        BLOCK_N=tiles.down_block_n, BLOCK_K=tiles.block_k, VEC=VEC, num_warps=tiles.num_warps,
        num_stages=1, **pdl.kwargs(x.device))
    if split > 1:
        sum_splits_kernel[(t, triton.cdiv(h, SUM_BLOCK))](part, x, out, t, h, split, h,
                                                     HAS_BIAS=False, BLOCK=SUM_BLOCK,
                                                     num_warps=4)
    return out


def experts_half_decode(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                        tiles: HalfDecodeTiles, w13_bias: torch.Tensor | None = None,
                        w2_bias: torch.Tensor | None = None,
                        activation: ExpertActivation = SILU,
                        shared: SharedExperts | None = None) -> torch.Tensor:
    """torch_experts.experts_torch's contract for 1..MAX_TOKENS tokens: x [T, H] (rows may
    be strided), w13 [E, 2I, H] (gate rows then up rows), w2 [E, H, I], topk_weights /
    topk_ids [T, k], optional biases w13_bias [E, 2I] and w2_bias [E, H] -> [T, H] in x's
    dtype; plus, with `shared`, the shared experts' MLP (shared_experts.py: its dense
    weights, S a multiple of I) run as S / I more slots of weight 1, or of sigmoid(x .
    shared.gate) with a gate. topk_ids must lie in [0, E) (not checked: reading them would
    sync the GPU)."""
    check_expert_inputs(x, w13, w2, topk_weights, topk_ids, w13_bias, w2_bias)
    if not 1 <= x.shape[0] <= MAX_TOKENS:
        raise ValueError(f"experts_half_decode: x has {x.shape[0]} tokens; it takes "
                         f"1..{MAX_TOKENS}")
    check_shared_fits(shared, x, w13.shape[1] // 2)
    return run_half_decode(x, w13, w2, topk_weights, topk_ids, tiles, w13_bias, w2_bias,
                           activation, shared)


def check_shared_fits(shared: SharedExperts | None, x: torch.Tensor, inter: int) -> None:
    """ValueError unless shared is None or its dense weights fit the decode kernels beside x
    and experts of intermediate size `inter`."""
    if shared is not None and not shared.chunks(x, inter):
        gu, dn = shared.gate_up, shared.down
        raise ValueError(
            f"shared experts: need dense gate_up [2S, {x.shape[1]}] and down "
            f"[{x.shape[1]}, S] (and, gated, gate [1, {x.shape[1]}]) in x's dtype {x.dtype}, "
            f"contiguous, S a multiple of the experts' I = {inter}; got "
            f"{None if gu is None else (tuple(gu.shape), gu.dtype)} / "
            f"{None if dn is None else (tuple(dn.shape), dn.dtype)} / "
            f"{None if shared.gate is None else (tuple(shared.gate.shape), shared.gate.dtype)}")
