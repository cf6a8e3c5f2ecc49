"""Triton kernels of a linear-attention decode step that read and write the recurrent states
in place, in the pages of the KV pool (shoal/attention/linear_state.py: a state is a run of
float32 words over a block's planes, conv state first): no gather of states into a batch
and no scatter back, one kernel for the short convolution and one for the delta rule.

- conv_step: y = silu(conv(state | x)) per channel; the state's window moves one token on.
- delta_rule_step: S = S * exp(g); S += k (beta (v - k^T S))^T; o = scale q^T S, with q and
  k L2-normed in the kernel and each key head serving num_v_heads / num_k_heads value heads.

Each row reads the state of block read[row] and writes block write[row] (the same block
within a block; the next one when a decode crosses into it). Tested against the torch ops
under TRITON_INTERPRET=1."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from shoal import pdl
from shoal.attention.ops.interpreted_half import to_dtype

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
              torch.float16: tl.float16}


@dataclass(frozen=True)
class PageWords:
    """Where a state's float32 word w of block b lies in the words tensor: plane
    w // per_plane, at b * block_stride + plane * plane_stride + w % per_plane."""

    words: torch.Tensor  # float32 view of the cache tensor
    per_plane: int
    plane_stride: int
    block_stride: int


@triton.jit
def _word_address(w, block, per_plane, plane_stride, block_stride):
    return block * block_stride + (w // per_plane) * plane_stride + w % per_plane


@triton.jit
def _tap(taps, t: tl.constexpr, KP: tl.constexpr):
    """Column t of taps [BC, KP]: a select and a sum, within each thread's registers where a
    thread holds a channel's KP taps (KP = 4, the shipped models; at other widths Triton may
    spread them over lanes, and the sum shuffles)."""
    return tl.sum(tl.where(tl.arange(0, KP)[None, :] == t, taps, 0.0), 1)


@triton.jit
def _conv_step_kernel(x_ptr, w_ptr, b_ptr, y_ptr, words_ptr, read_ptr, write_ptr, C,
                      stride_x, stride_y, per_plane, plane_stride, block_stride,
                      K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr,
                      HAS_BIAS: tl.constexpr, EARLY_STATES: tl.constexpr,
                      DTYPE: tl.constexpr, INTERPRETED: tl.constexpr,
                      PDL: tl.constexpr = False):
    pdl.launch_next(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    mask = c < C
    # the channels' K taps (and bias) load before the wait: weights are no step's output
    # (shoal/pdl.py), so their read overlaps the kernel before
    kk = tl.arange(0, KP)  # (K taps padded to a power of two)
    taps = tl.load(w_ptr + c[:, None] * K + kk[None, :], mask=mask[:, None] & (kk < K)[None, :],
                   other=0.0).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + c, mask=mask, other=0.0).to(tl.float32)
    # the block ids (the step's inputs, copied in before its first kernel) and, with
    # EARLY_STATES, the windows too (layers/linear_attention.py EARLY_READS)
    rb = tl.load(read_ptr + row).to(tl.int64)
    wb = tl.load(write_ptr + row).to(tl.int64)
    if EARLY_STATES:
        window = _window(words_ptr, c, mask, rb, per_plane, plane_stride, block_stride, K)
        pdl.wait_previous(PDL)
    else:
        pdl.wait_previous(PDL)
        window = _window(words_ptr, c, mask, rb, per_plane, plane_stride, block_stride, K)
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    acc = x * _tap(taps, K - 1, KP)
    if HAS_BIAS:
        acc += bias
    for t in tl.static_range(K - 1):  # the window holds the K - 1 inputs before x, oldest first
        acc += window[t] * _tap(taps, t, KP)
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(y_ptr + row * stride_y + c, to_dtype(y, DTYPE, INTERPRETED), mask=mask)
    # the window moves on from registers: every word was read above, before any store. In
    # place (rb == wb) that needs each channel in one warp (conv_step's warps: BC >= 32 x
    # warps, or one warp), whose load of a word is one instruction before its store
    for t in tl.static_range(K - 2):
        dst = _word_address(c * (K - 1) + t, wb, per_plane, plane_stride, block_stride)
        tl.store(words_ptr + dst, window[t + 1], mask=mask)
    last = _word_address(c * (K - 1) + K - 2, wb, per_plane, plane_stride, block_stride)
    tl.store(words_ptr + last, x, mask=mask)


@triton.jit
def _window(words_ptr, c, mask, rb, per_plane, plane_stride, block_stride, K: tl.constexpr):
    """The K - 1 window words of channels c in block rb, oldest first, as a tuple."""
    window = ()
    for t in tl.static_range(K - 1):
        a = _word_address(c * (K - 1) + t, rb, per_plane, plane_stride, block_stride)
        window = window + (tl.load(words_ptr + a, mask=mask, other=0.0),)
    return window


def conv_step(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              pages: PageWords, read: torch.Tensor, write: torch.Tensor, *,
              early_states: bool = False) -> torch.Tensor:
    """x [B, C] -> silu(conv) [B, C]; the conv states (words [0, C * (K - 1)) of a state)
    move from block read[b] to block write[b]. early_states: read them before waiting on
    the kernel before (PDL, shoal/pdl.py), for a caller whose step has no kernel launched
    with PDL write them first (layers/linear_attention.py EARLY_READS)."""
    b, c = x.shape
    k = weight.shape[1]
    y = torch.empty_like(x)
    block = min(256, triton.next_power_of_2(c))
    _conv_step_kernel[(b, triton.cdiv(c, block))](
        x, weight, bias if bias is not None else weight, y, pages.words, read, write, c,
        x.stride(0), y.stride(0), pages.per_plane, pages.plane_stride, pages.block_stride,
        K=k, KP=triton.next_power_of_2(k), BC=block, HAS_BIAS=bias is not None,
        EARLY_STATES=early_states, DTYPE=TL_DTYPES[x.dtype],
        INTERPRETED=x.device.type == "cpu",  # (TRITON_INTERPRET=1: round as the GPU does)
        num_warps=max(1, min(4, block // 32)),  # (no channel in two warps: see the kernel)
        **pdl.kwargs(x.device))
    return y


@triton.jit
def _delta_rule_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, words_ptr, read_ptr,
                       write_ptr, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb,
                       stride_vh, stride_gb, stride_gh, stride_beta, stride_ob, stride_oh,
                       state_offset, per_plane, plane_stride, block_stride, scale,
                       R: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                       G_PER_CHANNEL: tl.constexpr, PDL: tl.constexpr = False):
    pdl.grid_dependency(PDL)
    row, h, vt = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kh = h // R
    dk = tl.arange(0, DK)
    dv = vt * BV + tl.arange(0, BV)
    rb = tl.load(read_ptr + row).to(tl.int64)
    wb = tl.load(write_ptr + row).to(tl.int64)
    q = tl.load(q_ptr + row * stride_qb + kh * stride_qh + dk).to(tl.float32)
    k = tl.load(k_ptr + row * stride_kb + kh * stride_kh + dk).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, 0) + 1e-6)
    k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
    w = state_offset + h * DK * DV + dk[:, None] * DV + dv[None, :]  # [DK, BV] words
    s = tl.load(words_ptr + _word_address(w, rb, per_plane, plane_stride, block_stride))
    if G_PER_CHANNEL:
        g = tl.load(g_ptr + row * stride_gb + h * stride_gh + dk)
        s = s * tl.exp(g)[:, None]
    else:
        s = s * tl.exp(tl.load(g_ptr + row * stride_gb + h * stride_gh))
    v = tl.load(v_ptr + row * stride_vb + h * stride_vh + dv).to(tl.float32)
    beta = tl.load(beta_ptr + row * stride_beta + h)
    delta = (v - tl.sum(s * k[:, None], 0)) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], 0) * scale
    tl.store(words_ptr + _word_address(w, wb, per_plane, plane_stride, block_stride), s)
    tl.store(o_ptr + row * stride_ob + h * stride_oh + dv, o)


def delta_rule_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, pages: PageWords, state_offset: int,
                    read: torch.Tensor, write: torch.Tensor, scale: float) -> torch.Tensor:
    """q, k [B, Hk, Dk] (not yet L2-normed); v [B, H, Dv]; g [B, H] or [B, H, Dk] float32;
    beta [B, H] float32. The [H, Dk, Dv] states at word state_offset move from block read[b]
    to write[b]. Returns o [B, H, Dv] float32."""
    b, h, dv = v.shape
    dk = q.shape[2]
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("delta_rule_step needs unit-stride head dims")
    o = torch.empty(b, h, dv, dtype=torch.float32, device=v.device)
    g = g.contiguous()
    beta = beta.contiguous()
    block_v = min(32, dv)
    _delta_rule_kernel[(b, h, dv // block_v)](
        q, k, v, g, beta, o, pages.words, read, write, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1), beta.stride(0),
        o.stride(0), o.stride(1), state_offset, pages.per_plane, pages.plane_stride,
        pages.block_stride, scale, R=h // q.shape[1], DK=dk, DV=dv, BV=block_v,
        G_PER_CHANNEL=g.dim() == 3, **pdl.kwargs(v.device))
    return o


def kernel_fits(key_dim: int, value_dim: int) -> bool:
    """Head sizes the kernels take (powers of two: tl.arange)."""
    return all(d >= 16 and d & (d - 1) == 0 for d in (key_dim, value_dim))
