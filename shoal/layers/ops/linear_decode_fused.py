"""A linear-attention layer's decode step (one token a request) between its in-projections and
its out-projection, in two Triton kernels, the states read and written in place in their pages
of the KV pool.

What the torch path does there in ~20-30 launches a layer (issue 30: on the H100, a KDA
layer's ~47 us of small kernels against a few us of work), two kernels do:

- first, the older path's conv kernel (linear_state_decode.conv_step): the short causal
  conv + SiLU of every channel, the conv state's window moved on in its page. (Not inside
  the second kernel, even for KDA, where each value head owns its q, k and v channels:
  Triton replicates the window's words across warps in two layouts, so in place one warp's
  store of the moved window could land before another's load of it. Gated DeltaNet needs
  the split anyway: a key head's q and k serve several value heads.)
- a program per (request, value head), from registers:
  - q and k L2-normed; the decay g = -exp(A_log) * softplus(logits + dt_bias) (per head, or
    per key channel for KDA) and beta = sigmoid(b);
  - the gated delta rule S = S * exp(g); S += k (beta (v - k^T S))^T; o = scale q^T S on the
    float32 state [Dk, Dv] in its page (one read, one write);
  - the output's RMSNorm over Dv, times silu(z) (Gated DeltaNet) or sigmoid(gate) (KDA), in
    the model dtype, ready for the out-projection.

A value head's state may be cut into `split` column slices, a program each (the delta rule
is per column of S: k^T S, the update and q^T S): at batch 1 a (row, head) program a value
head gave Qwen3.5-35B-A3B 32 programs on 132 multiprocessors, 6.9 us a layer for ~2 MiB of
state read and written (H200, 2026-12-06). The output norm needs the head's whole o, so each
slice's program stores its o to a scratch row and the head's last program to finish (a
per-(row, head) counter, reset by it) norms and gates all of it, as the int4 wide GEMV's
split sums (deterministic: the same o, summed in one order). SHOAL_LINEAR_DECODE_SPLIT
picks it (default 1, one program a head, until the split has run on a GPU).

Roundings follow the torch path (shoal/layers/gated_delta_net.py, kimi_delta_attention.py):
the conv output, o and (Gated DeltaNet) weight * x are rounded to the model dtype where it
rounds them, so the two agree within float32 summation order. Each row reads the states of
block read[row] and writes block write[row], both read on the device (a decode graph's
buffers; padding rows read the null block and write the trash block, as on the other paths).
Under TRITON_INTERPRET=1 bf16 conversions go through interpreted_half.to_dtype (the
interpreter truncates where the GPU rounds)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shoal import envs, pdl
from shoal.attention.ops.interpreted_half import to_dtype
from shoal.layers.ops.linear_state_decode import TL_DTYPES, PageWords, conv_step
from shoal.layers.ops.program_counters import counters, counters_ready

# the largest state tile a program holds in registers: 128 x 128 float32, 128 a thread over
# 4 warps (ptxas on sm_90: 252 registers, no spills)
MAX_TILE = 128 * 128
DTYPES = tuple(TL_DTYPES)


@dataclass(frozen=True)
class DecodeGates:
    """What a layer's decode rows need beside the conv input: the decay and beta logits, the
    output gate and the output norm, with the torch path's conventions."""

    decay: torch.Tensor  # [B, H] (per head) or [B, H * Dk] (per key channel): before dt_bias
    dt_bias: torch.Tensor  # [H] or [H * Dk]
    a_log: torch.Tensor  # [H]
    beta: torch.Tensor  # [B, H] logits
    gate: torch.Tensor  # [B, H * Dv] the output gate's logits
    norm_weight: torch.Tensor  # [Dv]
    eps: float  # the output RMSNorm's
    kda: bool  # KDA's conventions (below) instead of Gated DeltaNet's

    # KDA (transformers' KimiDeltaAttention): q and k normed as x / sqrt(sum x^2 + 1e-6);
    # softplus as log(1 + exp(x)); beta's sigmoid rounded to the model dtype; output
    # weight * x * sigmoid(gate). Gated DeltaNet: x * rsqrt(...); log1p(exp(x)); beta in
    # float32; output (weight * x, rounded to the model dtype) * silu(z).


@triton.jit
def _softplus(x, LOG1P: tl.constexpr):
    """x above 20, else log(1 + exp(x)); LOG1P: accurate for small exp(x), as torch's
    F.softplus (log1p(e) = log(u) * e / (u - 1) with u = 1 + e, Goldberg's identity)."""
    e = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + e
    if LOG1P:
        small = tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0))
        sp = tl.where(u == 1.0, e, small)
    else:
        sp = tl.log(u)
    return tl.where(x > 20.0, x, sp)


@triton.jit
def _state_words(h, dk, dv, state_offset, per_plane, plane_stride, DK: tl.constexpr,
                 DV: tl.constexpr, ALIGNED: tl.constexpr):
    """Where the state [DK, DV] of head h lies in a block's part of the pages (add block x
    block_stride): words state_offset + h * DK * DV + i * DV + j, in one plane of the page
    or crossing into the next at a row boundary (fits(): a plane holds a whole tile, planes
    end on rows), each row's start picked per row."""
    w0 = state_offset + h * (DK * DV)
    p0 = (w0 // per_plane).to(tl.int64)
    first = (p0 + 1) * per_plane - w0  # the tile's words in plane p0 (a multiple of DV)
    rows = (dk * DV).to(tl.int64)
    row_at = tl.where(rows < first, p0 * plane_stride + (w0 - p0 * per_plane) + rows,
                      (p0 + 1) * plane_stride + (rows - first))
    if ALIGNED:  # (every term a multiple of 4 words: 16-byte accesses)
        row_at = tl.multiple_of(row_at, 4)
    return row_at[:, None] + dv[None, :]


@triton.jit
def _gated_output(o, z_ptrs, w_ptrs, eps, DV: tl.constexpr, KDA: tl.constexpr,
                  DTYPE: tl.constexpr, INTERPRETED: tl.constexpr):
    """The gated RMSNorm of a head's o [DV] (rounded to the model dtype first, as the torch
    path), in DTYPE: KDA's weight * x * sigmoid(gate), Gated DeltaNet's (weight * x in the
    model dtype) * silu(z)."""
    x = o
    if DTYPE != tl.float32:
        x = to_dtype(x, DTYPE, INTERPRETED).to(tl.float32)
    x = x * tl.rsqrt(tl.sum(x * x, 0) / DV + eps)
    w = tl.load(w_ptrs).to(tl.float32)
    z = tl.load(z_ptrs).to(tl.float32)
    if KDA:
        x = w * x * (1.0 / (1.0 + tl.exp(-z)))
    else:
        if DTYPE != tl.float32:
            x = to_dtype(x, DTYPE, INTERPRETED).to(tl.float32)
            x = to_dtype(w * x, DTYPE, INTERPRETED).to(tl.float32)
        else:
            x = w * x
        x = x * (z / (1.0 + tl.exp(-z)))
    if DTYPE != tl.float32:
        x = to_dtype(x, DTYPE, INTERPRETED)
    return x


@triton.jit
def _normed_qkv(y_row, kh, h, dk, dv, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                KDA: tl.constexpr):
    """q, k (key head kh), L2-normed, and v (value head h) in float32, from the conv kernel's
    output row. (The conv is not done here, even where a program owns its channels' windows:
    Triton replicates the window's words across warps in two layouts, so in place (rb == wb)
    one warp's store of the moved window can land before another warp's load of it; the
    sm_90 build showed no barrier between.)"""
    q = tl.load(y_row + kh * DK + dk).to(tl.float32)
    k = tl.load(y_row + (HK + kh) * DK + dk).to(tl.float32)
    v = tl.load(y_row + 2 * HK * DK + h * DV + dv).to(tl.float32)
    if KDA:  # (as transformers' KDA: sqrt and divide)
        q = q / tl.sqrt(tl.sum(q * q, 0) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k, 0) + 1e-6)
    else:
        q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    return q, k, v


@triton.jit
def _decode_kernel(y_ptr, stride_y, decay_ptr, stride_decay, dt_ptr, alog_ptr, beta_ptr,
                   stride_beta, gate_ptr, stride_gate, nw_ptr, out_ptr, stride_out, words_ptr,
                   read_ptr, write_ptr, state_offset, per_plane, plane_stride, block_stride,
                   scale, eps, o_part_ptr, count_ptr,
                   HK: tl.constexpr, R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   KDA: tl.constexpr, ALIGNED: tl.constexpr, EARLY_STATES: tl.constexpr,
                   DTYPE: tl.constexpr, INTERPRETED: tl.constexpr, SPLIT: tl.constexpr,
                   PDL: tl.constexpr = False):
    pdl.launch_next(PDL)
    row = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kh = h // R
    dk = tl.arange(0, DK)
    DVS: tl.constexpr = DV // SPLIT  # this program's columns of the head's state
    dv = tl.program_id(2) * DVS + tl.arange(0, DVS)
    # before the wait (shoal/pdl.py): the block ids (the step's inputs, copied in before its
    # first kernel), the decay's weights and, with EARLY_STATES, the state tile itself
    # (linear_attention.py EARLY_READS): its read, the largest of the kernel, overlaps the
    # conv kernel and the in-projection's tail
    rb = tl.load(read_ptr + row)
    wb = tl.load(write_ptr + row)
    at = _state_words(h, dk, dv, state_offset, per_plane, plane_stride, DK, DV, ALIGNED)
    a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    if KDA:
        dt = tl.load(dt_ptr + h * DK + dk).to(tl.float32)
    else:
        dt = tl.load(dt_ptr + h).to(tl.float32)
    if EARLY_STATES:
        s = tl.load(words_ptr + rb * block_stride + at)
        pdl.wait_previous(PDL)
    else:
        pdl.wait_previous(PDL)
        s = tl.load(words_ptr + rb * block_stride + at)

    q, k, v = _normed_qkv(y_ptr + row * stride_y, kh, h, dk, dv, HK, DK, DV, KDA)

    # the decay and the write strength
    beta = tl.load(beta_ptr + row * stride_beta + h).to(tl.float32)
    beta = 1.0 / (1.0 + tl.exp(-beta))
    if KDA:  # per key channel; beta's sigmoid in the model dtype
        f = tl.load(decay_ptr + row * stride_decay + h * DK + dk).to(tl.float32) + dt
        decay = tl.exp(a * _softplus(f, False))  # [DK]
        if DTYPE != tl.float32:
            beta = to_dtype(beta, DTYPE, INTERPRETED).to(tl.float32)
    else:
        f = tl.load(decay_ptr + row * stride_decay + h).to(tl.float32) + dt
        decay = tl.exp(a * _softplus(f, True)) + tl.zeros([DK], dtype=tl.float32)

    # S' = diag(decay) S + k delta^T with delta = beta (v - k^T diag(decay) S), and
    # o = scale q^T S' = scale ((q decay)^T S + (q . k) delta): both of S's reductions
    # read the old state, side by side, instead of one after the update
    ks = tl.sum(s * (k * decay)[:, None], 0)
    qs = tl.sum(s * (q * decay)[:, None], 0)
    delta = (v - ks) * beta  # v minus what S predicts for k
    s = s * decay[:, None] + k[:, None] * delta[None, :]
    o = (qs + tl.sum(q * k, 0) * delta) * scale
    tl.store(words_ptr + wb * block_stride + at, s)

    if SPLIT == 1:
        x = _gated_output(o, gate_ptr + row * stride_gate + h * DV + dv, nw_ptr + dv, eps,
                          DV, KDA, DTYPE, INTERPRETED)
        tl.store(out_ptr + row * stride_out + h * DV + dv, x)
    else:  # o's slice to the scratch row; the head's last program norms and gates it all
        head = row * tl.num_programs(1) + h
        tl.store(o_part_ptr + head * DV + dv, o)
        tl.debug_barrier()  # every thread's slice is written before the count goes up
        if tl.atomic_add(count_ptr + head, 1, sem="acq_rel") == SPLIT - 1:
            cols = tl.arange(0, DV)
            o_all = tl.load(o_part_ptr + head * DV + cols, cache_modifier=".cg")  # (at L2)
            y = _gated_output(o_all, gate_ptr + row * stride_gate + h * DV + cols,
                              nw_ptr + cols, eps, DV, KDA, DTYPE, INTERPRETED)
            tl.store(out_ptr + row * stride_out + h * DV + cols, y)
            tl.store(count_ptr + head, 0)  # ready for the next launch


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def conv_words(x: torch.Tensor, conv_weight: torch.Tensor) -> int:
    """Words of a state before its delta-rule part: the conv window, C x (K - 1)."""
    return x.shape[1] * (conv_weight.shape[1] - 1)


def fits(x: torch.Tensor, gates: DecodeGates, conv_weight: torch.Tensor, pages: PageWords,
         key_heads: int, heads: int, key_dim: int, value_dim: int) -> bool:
    """Shapes and layouts the kernels take (else the layer keeps its other decode path):
    power-of-two head sizes of at most MAX_TILE state words; a plane of the page holding a
    whole state tile, and the planes' ends falling on state rows (the shipped pages: a
    plane of block_size x an even number of words, block_size a multiple of 64, after
    C x (K - 1) conv words, C a multiple of the head size); whole value heads per key head;
    a float model dtype; rows of unit inner stride."""
    rows = (x, gates.decay, gates.beta, gates.gate)
    return (_pow2(key_dim) and _pow2(value_dim) and key_dim * value_dim <= MAX_TILE
            and pages.per_plane >= key_dim * value_dim
            and pages.per_plane % value_dim == 0
            and conv_words(x, conv_weight) % value_dim == 0
            and heads % key_heads == 0 and x.dtype in DTYPES and conv_weight.shape[1] >= 2
            and conv_weight.is_contiguous() and gates.norm_weight.is_contiguous()
            and all(t.dim() == 2 and t.stride(1) == 1 for t in rows)
            and gates.gate.shape[1] == heads * value_dim
            and gates.decay.shape[1] == heads * (key_dim if gates.kda else 1)
            and gates.dt_bias.is_contiguous() and gates.a_log.is_contiguous())


# Rows x heads from which a head's state is not split: enough programs without it.
SPLIT_ROWS_HEADS = 1024


def split_for(rows: int, heads: int, value_dim: int, device: torch.device) -> int:
    """Column slices a value head's state is cut into: SHOAL_LINEAR_DECODE_SPLIT (0: up to 4
    while rows x heads x split programs are fewer than the multiprocessors), never below 16
    columns a slice, nor where rows x heads >= SPLIT_ROWS_HEADS."""
    want = envs.SHOAL_LINEAR_DECODE_SPLIT.get()
    if want == 1 or rows * heads >= SPLIT_ROWS_HEADS:
        return 1
    if want == 0:
        sms = (torch.cuda.get_device_properties(device).multi_processor_count
               if device.type == "cuda" else 4)
        want = 1
        while want < 4 and rows * heads * want < sms:
            want *= 2
    split = 1
    while 2 * split <= want and value_dim // (2 * split) >= 16:  # (powers of two)
        split *= 2
    return split


def decode_step(x: torch.Tensor, conv_weight: torch.Tensor, conv_bias: torch.Tensor | None,
                gates: DecodeGates, pages: PageWords, state_offset: int, read: torch.Tensor,
                write: torch.Tensor, *, key_heads: int, heads: int, key_dim: int,
                value_dim: int, scale: float, early_states: bool = False,
                num_warps: int | None = None, split: int | None = None) -> torch.Tensor:
    """x [B, C] the conv input (q | k | v of key_heads, key_heads and heads heads); each row's
    conv window (words [0, state_offset)) and [heads, Dk, Dv] states move from block read[b]
    to write[b]. Returns the gated, normed output [B, heads * value_dim] in x's dtype, what
    the out-projection takes. Callers check fits() first. early_states: both kernels read the
    states before they wait on the kernel before (PDL, shoal/pdl.py), for a caller whose
    step has no kernel launched with PDL write them first (layers/linear_attention.py
    EARLY_READS). num_warps: for timing the choices.
    Two launches: every channel's conv (a key head's q and k serve R programs), then one
    program per (row, value head)."""
    b = x.shape[0]
    r = heads // key_heads
    dtype = TL_DTYPES[x.dtype]
    interpreted = x.device.type == "cpu"  # (TRITON_INTERPRET=1)
    if split is None:
        split = split_for(b, heads, value_dim, x.device)
    slice_cols = value_dim // max(split, 1)
    if split < 1 or value_dim % split or slice_cols & (slice_cols - 1):
        raise ValueError(f"split {split} must cut value_dim {value_dim} into power-of-two "
                         "slices")
    y = conv_step(x, conv_weight, conv_bias, pages, read, write, early_states=early_states)
    out = torch.empty(b, heads * value_dim, dtype=x.dtype, device=x.device)
    aligned = all(n % 4 == 0 for n in (state_offset, pages.per_plane, pages.plane_stride,
                                       pages.block_stride))
    if split > 1 and not counters_ready(x.device, b * heads):
        split = 1  # (a capture before any eager step of this size: one program a head)
    counts = counters(x.device, b * heads, "linear decode") if split > 1 else read
    if num_warps is None:  # the state tile at up to 128 words a thread (see MAX_TILE): on an
        # H100 each shipped layer's decode step (projections included, in a CUDA graph) took
        # 4-6 us less at batch 8 than at 64 a thread (8 warps: 172-181 registers, one
        # program an SM where 4 warps fit two), in two runs; at batch 1 the same within
        # 0.3 us in one run, 0.6-2.2 us less in the other
        num_warps = max(4, min(16, key_dim * value_dim // split // 4096))
    # (split: o's slices, float32, in a buffer of the step, graph-pool memory in a capture)
    o_part = (torch.empty(b * heads * value_dim, dtype=torch.float32, device=x.device)
              if split > 1 else out)
    _decode_kernel[(b, heads, split)](
        y, y.stride(0), gates.decay, gates.decay.stride(0), gates.dt_bias, gates.a_log,
        gates.beta, gates.beta.stride(0), gates.gate, gates.gate.stride(0), gates.norm_weight,
        out, out.stride(0), pages.words, read, write,
        state_offset, pages.per_plane, pages.plane_stride, pages.block_stride, scale,
        gates.eps, o_part, counts, HK=key_heads, R=r,
        DK=key_dim, DV=value_dim, KDA=gates.kda, ALIGNED=aligned, EARLY_STATES=early_states,
        DTYPE=dtype, INTERPRETED=interpreted, SPLIT=split, num_warps=num_warps,
        **pdl.kwargs(x.device))
    return out
