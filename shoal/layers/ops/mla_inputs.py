"""The two inputs of multi-head latent attention (DeepSeek-V2/V3 MLA, Kimi's MLA) in one
launch: the absorbed queries [T, H, L + R] and the latent rows to cache [T, L + R].

Unfused, a layer builds them from the projections in about seven kernels: copies of the
strided rotary slices, the rotary kernel, the latent's RMSNorm, and two concatenations. At
batch 1 each is a microsecond or two of launch-bound work, some 10 us a layer; DeepSeek-V2-Lite
has 27 such layers. Here program (t, h < H) writes query row (t, h): its latent-space part
copied from q_lat, its rotary part rotated; program (t, H) writes latent row t: the RMSNorm of
the compressed KV, then the rotated shared key.

Rounding is the unfused path's: the rotation in float32 rounded once (shoal/layers/ops/
rotary.py), the norm as shoal/layers/ops/rms_norm.py (the normalized row rounded to the
activation dtype before the weight multiply). Without a table (NoPE, Kimi) the rotary parts are
copied unrotated."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_into(src_ptr, dst_ptr, cos, sin, offs, mask, HALF: tl.constexpr,
                 ROTATE: tl.constexpr):
    x1 = tl.load(src_ptr + offs, mask=mask, other=0.0)
    x2 = tl.load(src_ptr + HALF + offs, mask=mask, other=0.0)
    if ROTATE:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        tl.store(dst_ptr + offs, (f1 * cos - f2 * sin).to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(dst_ptr + HALF + offs, (f2 * cos + f1 * sin).to(dst_ptr.dtype.element_ty),
                 mask=mask)
    else:
        tl.store(dst_ptr + offs, x1, mask=mask)
        tl.store(dst_ptr + HALF + offs, x2, mask=mask)


@triton.jit
def _mla_inputs_kernel(
    q_lat_ptr, q_pe_ptr, kv_ptr, pos_ptr, table_ptr, w_ptr, q_abs_ptr, latent_ptr,
    stride_lh, stride_lt, stride_qt, stride_qh, stride_kvt, stride_tab, stride_at, stride_ah,
    stride_latt, num_heads, eps,
    L: tl.constexpr, HALF: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ROTATE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    dmask = offs_d < HALF
    cos = 1.0
    sin = 0.0
    if ROTATE:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        cos = tl.load(table_ptr + pos * stride_tab + offs_d, mask=dmask, other=0.0)
        sin = tl.load(table_ptr + pos * stride_tab + HALF + offs_d, mask=dmask, other=0.0)
    offs = tl.arange(0, BLOCK_L)
    lmask = offs < L
    if h < num_heads:
        row = q_abs_ptr + t * stride_at + h * stride_ah
        v = tl.load(q_lat_ptr + h * stride_lh + t * stride_lt + offs, mask=lmask, other=0.0)
        tl.store(row + offs, v.to(q_abs_ptr.dtype.element_ty), mask=lmask)
        _rotate_into(q_pe_ptr + t * stride_qt + h * stride_qh, row + L, cos, sin, offs_d, dmask,
                     HALF, ROTATE)
    else:
        row = latent_ptr + t * stride_latt
        c = tl.load(kv_ptr + t * stride_kvt + offs, mask=lmask, other=0.0)
        cf = c.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(cf * cf, 0) / L + eps)
        w = tl.load(w_ptr + offs, mask=lmask, other=0.0)
        y = (cf * rstd).to(c.dtype).to(tl.float32) * w.to(tl.float32)
        tl.store(row + offs, y.to(latent_ptr.dtype.element_ty), mask=lmask)
        _rotate_into(kv_ptr + t * stride_kvt + L, row + L, cos, sin, offs_d, dmask, HALF,
                     ROTATE)


def mla_inputs(q_lat: torch.Tensor, q_pe: torch.Tensor, kv_a: torch.Tensor,
               positions: torch.Tensor, rope_table: torch.Tensor | None,
               norm_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q_lat [H, T, L] (each head's query in the latent space); q_pe [T, H, R] (the queries'
    rotary parts, a strided view of the q projection is fine); kv_a [T, L + R] (the kv_a
    projection: compressed KV, then the shared rotary key); positions [T] int; rope_table
    [max_pos, R] float32 (cos half, then sin half: RotaryEmbedding.cos_sin_cache), None to
    leave the rotary parts unrotated; norm_weight [L]: the kv_a RMSNorm's.
    Returns (q_abs [T, H, L + R], latent [T, L + R]) in kv_a's dtype."""
    h, t, lat = q_lat.shape
    if q_pe.dim() != 3 or q_pe.shape[:2] != (t, h):
        raise ValueError(f"q_pe {tuple(q_pe.shape)} must be [T={t}, H={h}, R]")
    rope = q_pe.shape[2]
    if rope % 2 or kv_a.shape != (t, lat + rope):
        raise ValueError(f"kv_a {tuple(kv_a.shape)} must be [T={t}, L + R = {lat + rope}] "
                         f"with R even")
    if norm_weight.shape != (lat,):
        raise ValueError(f"norm_weight {tuple(norm_weight.shape)} must be [{lat}]")
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32/int64 [{t}]")
    if rope_table is not None and (rope_table.dim() != 2 or rope_table.shape[1] != rope
                                   or rope_table.stride(1) != 1):
        raise ValueError(f"rope_table must be [max_pos, {rope}] with contiguous rows")
    for name, x in (("q_lat", q_lat), ("q_pe", q_pe), ("kv_a", kv_a)):
        if x.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dim")
    dtype = kv_a.dtype
    q_abs = torch.empty(t, h, lat + rope, dtype=dtype, device=kv_a.device)
    latent = torch.empty(t, lat + rope, dtype=dtype, device=kv_a.device)
    if t == 0:
        return q_abs, latent
    table = rope_table if rope_table is not None else kv_a  # (not read without ROTATE)
    block_l = triton.next_power_of_2(lat)
    _mla_inputs_kernel[(t, h + 1)](
        q_lat, q_pe, kv_a, positions, table, norm_weight, q_abs, latent,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv_a.stride(0),
        table.stride(0), q_abs.stride(0), q_abs.stride(1), latent.stride(0), h, eps,
        L=lat, HALF=rope // 2, BLOCK_L=block_l, BLOCK_HALF=triton.next_power_of_2(rope // 2),
        ROTATE=rope_table is not None, num_warps=4 if block_l <= 1024 else 8,
    )
    return q_abs, latent
