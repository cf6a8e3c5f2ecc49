"""Weight-only GEMV for a few rows (decode): y = x W^T with x in bf16/fp16/fp32 and W in FP8
or INT4, dequantized in registers, no tensor cores. At batch 1 a decode step is a weight read:
the FP8 paths of methods.py first quantize the activations (one more kernel) and then run an
FP8 GEMM built for many rows; here each program streams a strip of BLOCK_N output rows (FP8:
rows of W, contiguous along K; INT4: GPTQ's words, contiguous along N) over its share of K,
multiplies with every one of the M <= MAX_ROWS activation rows held in registers, and reduces
along K inside the program. Shared memory is not used, so nothing limits the strips in flight
but registers.

split > 1: the K range is cut into `split` programs per strip writing float32 partials
[split, M, N] that one sum adds (deterministic: no atomics), for shapes with too few strips
to fill the GPU (a 4096-row output of a 14336-wide input).

FP8 block scales (weight_block_size): a K step within one group reads each row's scale every
step; a step of several groups (_fp8_group_steps) reads the step's scales together and,
where the strip lies in one row block of scales, multiplies them into the activations, so
that a weight costs one FMA as on the per-channel path. The tuner times both kinds.

INT4 has two more kernels: int4_wide_gemv.py (tiles.kernel "wide": fewer instructions a code,
the rows sharing each dequantized code, a K split summed by the strip's last program) and
int4_mma_gemv.py (tiles.kernel "mma": the products on tensor cores, two codes made by one
instruction); the tuner times all three kinds."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from shoal import pdl
from shoal.layers.quantization.int4_mma_gemv import MAGIC as MMA_MAGIC
from shoal.layers.quantization.int4_mma_gemv import TILED_WORDS, int4_mma_gemv
from shoal.layers.quantization.int4_mma_gemv import launches as mma_launches
from shoal.layers.quantization.int4_wide_gemv import int4_wide_gemv, partial_chunk

MAX_ROWS = 8  # activation rows one program holds; more rows take the tensor-core kernels
MAX_STEP_GROUPS = 4  # block-scale groups a candidate's K step spans at most


@dataclass(frozen=True)
class GemvTiles:
    block_n: int
    block_k: int  # inputs per K step (INT4: 8 per word)
    split: int
    num_warps: int = 4
    num_stages: int = 3
    kernel: str = "strip"  # INT4: "strip" (here), "wide" or "mma" (int4_*_gemv.py)
    prefetch: bool = False  # "wide": the next step's words load during this step's math
    tiled: bool = False  # "mma": codes in int4_mma_gemv.tile_codes' layout (SHOAL_INT4_TILED)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, K_SPLIT, SCALE_ROWS,
                     stride_xm, stride_wn, stride_sn, stride_os, stride_om,
                     PER_ROW: tl.constexpr, GROUP: tl.constexpr, STRIP_SCALES: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PDL: tl.constexpr = False, EARLY: tl.constexpr = False):
    # EARLY (one row, per-channel scales): the first K step's weights load before the wait
    if EARLY:
        pdl.launch_next(PDL)
    else:
        pdl.grid_dependency(PDL)
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok, m_ok = offs_n < N, offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    if not PER_ROW and BLOCK_K > GROUP:
        acc = _fp8_group_steps(x_ptr, w_ptr, s_ptr, pid_n, offs_n, offs_m, n_ok, m_ok, k_start,
                               k_end, SCALE_ROWS, stride_xm, stride_wn, stride_sn, GROUP,
                               STRIP_SCALES, BLOCK_M, BLOCK_N, BLOCK_K)
    elif BLOCK_M == 1:
        # Batch-1 decode: the products add up elementwise in a [BLOCK_N, BLOCK_K] tile that
        # is reduced across K once at the end (a reduction per step would cost a cross-warp
        # exchange every step).
        wide = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        first = k_start
        if EARLY:  # (PER_ROW) the first step, its weights read before the wait
            offs_k = k_start + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_end
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            pdl.wait_previous(PDL)
            wide += w * tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            first = k_start + BLOCK_K
        for k0 in range(first, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_end
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            x1 = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            if PER_ROW:
                wide += w * x1[None, :]
            else:  # a block scale: BLOCK_K divides GROUP, one scale per row serves the step
                s = tl.load(s_ptr + (offs_n // SCALE_ROWS).to(tl.int64) * stride_sn
                            + k0 // GROUP, mask=n_ok, other=0.0)
                wide += w * (x1[None, :] * s[:, None])
        acc = tl.sum(wide, axis=1)[None, :]
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < k_end
            w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            part = tl.sum(w[None, :, :] * x[:, None, :], axis=2)
            if PER_ROW:
                acc += part
            else:
                s = tl.load(s_ptr + (offs_n // SCALE_ROWS).to(tl.int64) * stride_sn
                            + k0 // GROUP, mask=n_ok, other=0.0)
                acc += part * s[None, :]
    if PER_ROW:
        acc = acc * tl.load(s_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
    out = out_ptr + pid_k.to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om
    tl.store(out + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_group_steps(x_ptr, w_ptr, s_ptr, pid_n, offs_n, offs_m, n_ok, m_ok, k_start, k_end,
                     SCALE_ROWS, stride_xm, stride_wn, stride_sn, GROUP: tl.constexpr,
                     STRIP_SCALES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """Block scales with a K step of GROUPS = BLOCK_K / GROUP scale groups -> [BLOCK_M,
    BLOCK_N] sums. A step of one group (the kernel's other branch) is short and reloads a
    scale per row every step; here a step reads GROUPS scales. STRIP_SCALES: the strip's
    rows share one row of scales (BLOCK_N divides SCALE_ROWS: 128-row weight blocks), so
    the scales multiply the step's activations and the weights take one FMA each, as the
    per-channel path's; else each row's own scales multiply its products."""
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    offs_g = tl.arange(0, GROUPS)
    offs_j = tl.arange(0, GROUP)
    # a step's groups past k_end read the last one's scales (in bounds; their weights are 0)
    g_last = (k_end - 1) // GROUP
    if STRIP_SCALES:
        s_row = s_ptr + ((pid_n * BLOCK_N) // SCALE_ROWS).to(tl.int64) * stride_sn
    else:
        s_rows = s_ptr + (offs_n // SCALE_ROWS).to(tl.int64) * stride_sn
    if BLOCK_M == 1:
        # the step as a [BLOCK_N, GROUPS, GROUP] tile: whole-row vector loads as in the
        # per-channel path, a scale per group broadcast along its GROUP inputs, the products
        # summed elementwise and reduced once at the end
        sub = offs_g[:, None] * GROUP + offs_j[None, :]
        w3 = w_ptr + offs_n.to(tl.int64)[:, None, None] * stride_wn
        wide = tl.zeros([BLOCK_N, GROUPS, GROUP], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            offs_k = k0 + sub
            k_ok = offs_k < k_end
            w = tl.load(w3 + offs_k[None, :, :], mask=n_ok[:, None, None] & k_ok[None, :, :],
                        other=0.0).to(tl.float32)
            x = tl.load(x_ptr + offs_k, mask=k_ok, other=0.0).to(tl.float32)
            g = tl.minimum(k0 // GROUP + offs_g, g_last)
            if STRIP_SCALES:
                wide += w * (x * tl.load(s_row + g)[:, None])[None, :, :]
            else:
                s = tl.load(s_rows[:, None] + g[None, :], mask=n_ok[:, None], other=0.0)
                wide += w * (x[None, :, :] * s[:, :, None])
        acc = tl.sum(tl.sum(wide, axis=2), axis=1)[None, :]
    else:
        w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            if STRIP_SCALES:
                # more rows, one scale row: the scales multiply the activations (a scale per
                # input, read by its group) and the step is the per-channel path's
                offs_k = k0 + tl.arange(0, BLOCK_K)
                k_ok = offs_k < k_end
                w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                            other=0.0).to(tl.float32)
                x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                            other=0.0).to(tl.float32)
                s = tl.load(s_row + tl.minimum(offs_k // GROUP, g_last))
                acc += tl.sum(w[None, :, :] * (x * s[None, :])[:, None, :], axis=2)
            else:
                # more rows, a scale row each: the step's groups one after another (a
                # [BLOCK_M, BLOCK_N, GROUP] product each, reduced and scaled), unrolled so
                # that their loads are issued together
                for i in tl.static_range(GROUPS):
                    offs_k = k0 + i * GROUP + offs_j
                    k_ok = offs_k < k_end
                    w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                                other=0.0).to(tl.float32)
                    x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                                other=0.0).to(tl.float32)
                    part = tl.sum(w[None, :, :] * x[:, None, :], axis=2)
                    s = tl.load(s_rows + tl.minimum(k0 // GROUP + i, g_last), mask=n_ok,
                                other=0.0)
                    acc += part * s[None, :]
    return acc


@triton.jit
def _int4_gemv_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, K_SPLIT, GROUP,
                      stride_xm, stride_wk, stride_sg, stride_os, stride_om,
                      HAS_ZERO: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_W: tl.constexpr):
    """BLOCK_W words along K a step (8 inputs each), all in one group of scales."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    n_ok, m_ok = offs_n < N, offs_m < M
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    # batch 1: products add up elementwise in a [BLOCK_W, BLOCK_N] tile, reduced over the
    # words once at the end; more rows: reduced every step
    wide = tl.zeros([BLOCK_W, BLOCK_N], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_W * 8):
        offs_w = k0 // 8 + tl.arange(0, BLOCK_W)
        words = tl.load(w_ptr + offs_w.to(tl.int64)[:, None] * stride_wk + offs_n[None, :],
                        mask=(offs_w * 8 < k_end)[:, None] & n_ok[None, :], other=0)
        g = (k0 // GROUP).to(tl.int64)
        scale = tl.load(s_ptr + g * stride_sg + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_ZERO:
            zero = tl.load(z_ptr + g * stride_sg + offs_n, mask=n_ok, other=0).to(tl.float32)
        else:
            zero = tl.full([BLOCK_N], 8.0, dtype=tl.float32)
        if BLOCK_M == 1:
            step = tl.zeros([BLOCK_W, BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(8):
                code = ((words >> (4 * j)) & 0xF).to(tl.float32) - zero[None, :]
                ks = offs_w * 8 + j
                x1 = tl.load(x_ptr + ks, mask=ks < k_end, other=0.0).to(tl.float32)
                step += code * x1[:, None]
            wide += step * scale[None, :]
        else:
            part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for j in tl.static_range(8):
                code = ((words >> (4 * j)) & 0xF).to(tl.float32) - zero[None, :]
                ks = offs_w * 8 + j
                x = tl.load(x_rows + ks[None, :], mask=m_ok[:, None] & (ks < k_end)[None, :],
                            other=0.0).to(tl.float32)
                part += tl.sum(x[:, :, None] * code[None, :, :], axis=1)
            acc += part * scale[None, :]
    if BLOCK_M == 1:
        acc = tl.sum(wide, axis=0)[None, :]
    out = out_ptr + pid_k.to(tl.int64) * stride_os + offs_m.to(tl.int64)[:, None] * stride_om
    tl.store(out + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _rows(m: int) -> int:
    if not 0 < m <= MAX_ROWS:
        raise ValueError(f"decode GEMV takes 1..{MAX_ROWS} rows, got {m}")
    return triton.next_power_of_2(m)


def _span(k: int, step: int, split: int) -> tuple[int, int]:
    """(inputs per split, whole steps; splits left with inputs)."""
    span = triton.cdiv(triton.cdiv(k, step), split) * step
    return span, triton.cdiv(k, span)


def _finish(out: torch.Tensor, split: int, dtype: torch.dtype) -> torch.Tensor:
    return out if split == 1 else out.sum(0).to(dtype)


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, tiles: GemvTiles, *,
             group: int = 0, scale_rows: int = 1, early: bool | None = None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), w float8 [N, K]; w_scale float32 [N] (group 0: one scale per
    output row) or [ceil(N / scale_rows), ceil(K / group)] (block scales; tiles.block_k
    divides group, or is a multiple of it: a K step of several groups) -> [M, N] in x's
    dtype. early: the kernel's EARLY (one row, per-channel; None: with PDL, see shoal/pdl.py;
    a test sets it to run the peeled first step without PDL)."""
    m, k = x.shape
    n = w.shape[0]
    if w.shape[1] != k or x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError(f"fp8_gemv: x {tuple(x.shape)} and w {tuple(w.shape)} need the same "
                         "K and contiguous rows")
    if group and group % tiles.block_k and tiles.block_k % group:
        raise ValueError(f"fp8_gemv: block_k {tiles.block_k} must divide the group {group} "
                         "or be a multiple of it")
    span, split = _span(k, tiles.block_k, tiles.split)
    out = torch.empty((split, m, n) if split > 1 else (m, n),
                      dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    launch = pdl.kwargs(x.device)
    if early is None:
        early = bool(launch)
    early = early and m == 1 and not group
    _fp8_gemv_kernel[(triton.cdiv(n, tiles.block_n), split)](
        x, w, w_scale, out, m, n, k, span, scale_rows, x.stride(0), w.stride(0),
        w_scale.stride(0) if group else 0, m * n, n, PER_ROW=group == 0, GROUP=max(group, 1),
        STRIP_SCALES=bool(group) and scale_rows % tiles.block_n == 0, BLOCK_M=_rows(m),
        BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps,
        num_stages=tiles.num_stages, EARLY=early, **launch)
    return _finish(out, split, x.dtype)


def int4_gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
              zeros: torch.Tensor | None, group: int, tiles: GemvTiles) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS); codes int32 [ceil(K / 8), N], scales [G, N], zeros uint8
    [G, N] or None (8), as w4a16_gemm.py; tiles.block_k (a multiple of 8) divides the group
    unless one group spans K."""
    m, k = x.shape
    if tiles.tiled:  # codes in tile_codes' layout: the tensor-core kernel checks them
        if tiles.kernel != "mma":
            raise ValueError(f"int4_gemv: tiled codes take the 'mma' kernel, not "
                             f"{tiles.kernel!r}")
        return int4_mma_gemv(x, codes, scales, zeros, group, block_n=tiles.block_n,
                             words=tiles.block_k // 8, split=tiles.split,
                             num_warps=tiles.num_warps, num_stages=tiles.num_stages,
                             tiled=True)
    n = codes.shape[1]
    if codes.shape[0] != triton.cdiv(k, 8) or scales.shape[1] != n or x.stride(1) != 1:
        raise ValueError(f"int4_gemv: x {tuple(x.shape)}, codes {tuple(codes.shape)}, "
                         f"scales {tuple(scales.shape)} do not fit")
    if tiles.block_k % 8 or (group < k and group % tiles.block_k):
        raise ValueError(f"int4_gemv: block_k {tiles.block_k} must be a multiple of 8 that "
                         f"divides the group {group}")
    if tiles.kernel == "wide":
        return int4_wide_gemv(x, codes, scales, zeros, group, block_n=tiles.block_n,
                              step_w=tiles.block_k // 8, split=tiles.split,
                              prefetch=tiles.prefetch, num_warps=tiles.num_warps,
                              num_stages=tiles.num_stages)
    if tiles.kernel == "mma":
        return int4_mma_gemv(x, codes, scales, zeros, group, block_n=tiles.block_n,
                             words=tiles.block_k // 8, split=tiles.split,
                             num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    if tiles.kernel != "strip":
        raise ValueError(f"int4_gemv: kernel {tiles.kernel!r} is not 'strip', 'wide' or 'mma'")
    span, split = _span(k, tiles.block_k, tiles.split)
    out = torch.empty((split, m, n) if split > 1 else (m, n),
                      dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    _int4_gemv_kernel[(triton.cdiv(n, tiles.block_n), split)](
        x, codes, scales, zeros if zeros is not None else scales, out, m, n, k, span,
        max(group, 1) if group < k else 1 << 30,  # one group over K: group 0 for every step
        x.stride(0), codes.stride(0), scales.stride(0), m * n, n, HAS_ZERO=zeros is not None,
        BLOCK_M=_rows(m), BLOCK_N=tiles.block_n, BLOCK_W=tiles.block_k // 8,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return _finish(out, split, x.dtype)


# Per-channel FP8 at one row: longer K steps of few rows, for more bytes in flight an SM
# where the strips are few. On the H200 (2026-12-06) the 8B's down projection (K 14336, N
# 4096) ran at 0.57 of the copy bandwidth with n8 k512's 512 programs of 4 KB steps, where
# gate_up's 1,792 programs of the same steps reached 0.83. In the one-row tile a thread
# holds rows x inputs / 128 float32 sums (32 to 64 here; 71-127 registers on sm_90, no
# spills). The tuner keeps them only if faster.
ONE_ROW_LONG_STEPS = ((4, 1024), (8, 1024), (4, 2048))


def fp8_candidates(n: int, k: int, group: int, device: torch.device, rows: int = 1
                   ) -> list[GemvTiles]:
    """Launch shapes worth timing for an FP8 weight [N, K] (group: block-scale width or 0)
    at `rows` activation rows (a power of two). Block scales take the strips whose K step is
    within a group, then those whose step spans 2 to MAX_STEP_GROUPS groups (the per-channel
    path's long steps); per-channel weights at one row also ONE_ROW_LONG_STEPS."""
    strips = ((16, 32), (8, 16)) if device.type != "cuda" else (
        (8, 512), (16, 256), (32, 128), (16, 128), (64, 64))
    if device.type == "cuda" and rows == 1 and not group:
        strips += tuple(s for s in ONE_ROW_LONG_STEPS if s[1] <= k)
    if not group:
        return _with_splits(list(strips), n, (1, 2, 4), device)
    within = [s for s in strips if group % s[1] == 0]
    spanning = [s for s in strips if s[1] % group == 0 and 1 < s[1] // group <= MAX_STEP_GROUPS]
    return _with_splits(within + spanning, n, (1, 2, 4), device)


def int4_candidates(n: int, k: int, group: int, device: torch.device, rows: int = 1,
                    dtype: torch.dtype | None = None,
                    tiled_block_n: int | None = None) -> list[GemvTiles]:
    """Launch shapes worth timing for INT4 codes [K / 8, N] of group `group` at `rows`
    activation rows (a power of two up to MAX_ROWS) of `dtype`: the strip kernel's, the
    wide kernel's (whose registers grow with the rows), then the tensor-core kernel's; with
    tiled_block_n (a copy of the codes in tile_codes' layout of that width, 16 words a step),
    the tensor-core tiles of that width once more, reading the copy."""
    strips = ((16, 16), (32, 8)) if device.type != "cuda" else (
        (64, 64), (128, 32), (32, 128), (64, 128), (128, 64), (256, 32))
    fits = [s for s in strips if group >= k or group % s[1] == 0]
    return (_with_splits(fits, n, (1, 2, 4, 8), device) + _wide(n, k, group, rows, device)
            + _mma(n, k, group, device, dtype, tiled_block_n))


# "wide" tiles per row count: (block_n, step words, prefetch), one warp a program. Each
# thread holds step x block_n / 32 words and rows x that many float32 sums: at one row 64
# words a thread (106-170 registers from Triton's sm_90 compiler, 12-19 programs an SM),
# fewer words with more rows so that 8 rows stay within 255 registers without spilling.
# With few words a step, prefetch costs few registers and keeps two steps of loads in flight.
# Ten compiled kernels in all (a tile's splits share one): start-up time stays small.
_WIDE = {1: ((256, 8, False), (256, 8, True), (512, 4, True), (128, 16, False)),
         2: ((256, 4, False), (256, 4, True)),
         4: ((256, 2, True), (128, 4, False)),
         8: ((256, 1, True), (128, 2, True))}


def _wide(n: int, k: int, group: int, rows: int, device: torch.device) -> list[GemvTiles]:
    if device.type != "cuda":  # the interpreter: one tile, split (few steps: it is slow)
        return [GemvTiles(64, 32, 2, num_warps=1, num_stages=1, kernel="wide")] \
            if group >= k or group % 32 == 0 else []
    return wide_tiles(n, k, group, rows, torch.cuda.get_device_properties(device)
                      .multi_processor_count)


def wide_tiles(n: int, k: int, group: int, rows: int, sms: int) -> list[GemvTiles]:
    """The wide kernel's candidates on a GPU of `sms` multiprocessors: each tile of _WIDE
    with up to three K splits (powers of two) that give about 4, 8 and 16 one-warp programs
    a multiprocessor. Never one split: a strip's single warp cannot keep a multiprocessor's
    loads in flight. At most: K / 128 (the float32 partials stay within 6 % of the weight's
    bytes), four rounds of the last program's partial loads (partial_chunk), half the K
    steps (two steps a program, or one where K is short)."""
    out = []
    for block_n, words, prefetch in _WIDE[rows]:
        if group < k and group % (words * 8):
            continue
        strips, steps = triton.cdiv(n, block_n), triton.cdiv(k, words * 8)
        most = min(k // 128, 4 * partial_chunk(rows, block_n // 32), max(2, steps // 2))
        most = 1 << max(1, most.bit_length() - 1)  # a power of two, at least 2
        splits = sorted({min(most, max(2, 1 << round(math.log2(per_sm * sms / strips))))
                         for per_sm in (4, 8, 16)})
        out += [GemvTiles(block_n, words * 8, split, num_warps=1, num_stages=1,
                          kernel="wide", prefetch=prefetch) for split in splits]
    return out


def _mma(n: int, k: int, group: int, device: torch.device, dtype: torch.dtype | None,
         tiled_block_n: int | None = None) -> list[GemvTiles]:
    """int4_mma_gemv.launches as tiles, on a GPU with tensor cores for these (NVIDIA sm_80
    on: the kernel's inline PTX) and bf16 / fp16 activations; none in the interpreter (its
    tests call the kernel directly)."""
    if (device.type != "cuda" or torch.version.hip or dtype not in MMA_MAGIC
            or torch.cuda.get_device_capability(device)[0] < 8):
        return []
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    plain = [GemvTiles(block_n, 8 * words, split, num_warps=warps, num_stages=1, kernel="mma")
             for block_n, words, split, warps in mma_launches(n, k, group, sms)]
    return plain + [replace(t, tiled=True) for t in plain
                    if t.block_n == tiled_block_n and t.block_k == 8 * TILED_WORDS]


def _with_splits(strips: list[tuple[int, int]], n: int, splits: tuple[int, ...],
                 device: torch.device) -> list[GemvTiles]:
    """Each strip (block_n, block_k) unsplit, and split while the programs stay within four
    per multiprocessor (the interpreter: one split of each)."""
    if device.type != "cuda":
        return [GemvTiles(bn, bk, 1 + i % 2) for i, (bn, bk) in enumerate(strips)]
    room = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return [GemvTiles(bn, bk, split) for bn, bk in strips for split in splits
            if split == 1 or triton.cdiv(n, bn) * split <= room]
