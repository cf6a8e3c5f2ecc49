"""Per-head q/k RMSNorm, neox rotary and the paged-cache write in one kernel.

One launch where the unfused layer makes two (rotary, cache write) or, with q/k norm, four
to six (the norms also copy their strided qkv views first when T > 1). q is normalized
and rotated in place; k is normalized, rotated and written straight into its cache slot
together with v. k's own buffer is left as it was: the paged attention kernels read every
key, the step's new ones included, from the cache.

Grid (T, q head blocks + kv head blocks): a program handles BLOCK_H query heads or
BLOCK_H key/value heads of one token, so a batch-1 decode still spreads over a few
programs. Each head is loaded as its two rotated halves plus the unrotated tail past
rot_dim, so every feature is read once.

Rounding follows the unfused path (shoal.layers.norm.RMSNorm, then layers/ops/rotary.py): the
normalized row is rounded to the activation dtype before and after the weight multiply,
the rotation runs in fp32 and is rounded once. An FP8 cache (KV_FP8) then takes that key,
and v, divided by their scales, saturated and rounded (ops/fp8.py), as the unfused write does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal import pdl
from shoal.attention import kv_quant
from shoal.attention.ops.fp8 import check_fp8_cache, to_fp8


@triton.jit
def _norm_rope(row, hmask, cos, sin, w_ptr, eps, BLOCK_H: tl.constexpr,
               HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
               PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, NORM: tl.constexpr):
    """row: [BLOCK_H, 1] pointers to each head's first feature. Returns the rotated halves
    and the tail (zeros when rot_dim == head_dim), in the input dtype."""
    offs = tl.arange(0, BLOCK_HALF)[None, :]
    m = hmask[:, None] & (offs < HALF)
    x1 = tl.load(row + offs, mask=m, other=0.0)
    x2 = tl.load(row + HALF + offs, mask=m, other=0.0)
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    offs_p = tl.arange(0, BLOCK_PASS)[None, :]
    mp = hmask[:, None] & (offs_p < PASS)
    if PASS > 0:
        fp = tl.load(row + 2 * HALF + offs_p, mask=mp, other=0.0).to(tl.float32)
    else:
        fp = tl.zeros([BLOCK_H, BLOCK_PASS], tl.float32)
    if NORM:
        sq = tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)
        if PASS > 0:
            sq += tl.sum(fp * fp, 1)
        rstd = tl.rsqrt(sq / HEAD_DIM + eps)[:, None]
        dt = x1.dtype
        w1 = tl.load(w_ptr + offs, mask=offs < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)
        f1 = ((f1 * rstd).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        f2 = ((f2 * rstd).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
        if PASS > 0:
            wp = tl.load(w_ptr + 2 * HALF + offs_p, mask=offs_p < PASS, other=0.0)
            fp = (fp * rstd).to(dt).to(tl.float32) * wp.to(tl.float32)
    o1 = (f1 * cos - f2 * sin).to(x1.dtype)
    o2 = (f2 * cos + f1 * sin).to(x1.dtype)
    return o1, o2, fp.to(x1.dtype)


@triton.jit
def _store_head(row, hmask, o1, o2, op, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
                PASS: tl.constexpr, BLOCK_PASS: tl.constexpr, STORE_PASS: tl.constexpr):
    offs = tl.arange(0, BLOCK_HALF)[None, :]
    m = hmask[:, None] & (offs < HALF)
    tl.store(row + offs, o1, mask=m)
    tl.store(row + HALF + offs, o2, mask=m)
    if STORE_PASS:
        offs_p = tl.arange(0, BLOCK_PASS)[None, :]
        tl.store(row + 2 * HALF + offs_p, op, mask=hmask[:, None] & (offs_p < PASS))


@triton.jit
def _rope_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, pos_ptr, slot_ptr, cs_ptr, qw_ptr, kw_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch,
    stride_rope, num_q_heads, num_kv_heads, num_q_blocks, eps, k_scale, v_scale,
    HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, PASS: tl.constexpr,
    BLOCK_PASS: tl.constexpr, BLOCK_H: tl.constexpr,
    Q_NORM: tl.constexpr, K_NORM: tl.constexpr, KV_FP8: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.grid_dependency(PDL)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    dmask = offs < HALF
    cos = tl.load(cs_ptr + pos * stride_rope + offs, mask=dmask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_rope + HALF + offs, mask=dmask,
                  other=0.0).to(tl.float32)
    cos, sin = cos[None, :], sin[None, :]
    if hb < num_q_blocks:
        heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < num_q_heads
        row = q_ptr + t * stride_qt + heads[:, None] * stride_qh
        o1, o2, op = _norm_rope(row, hmask, cos, sin, qw_ptr, eps, BLOCK_H, HEAD_DIM, HALF,
                                BLOCK_HALF, PASS, BLOCK_PASS, Q_NORM)
        if Q_NORM:
            _store_head(row, hmask, o1, o2, op, HALF, BLOCK_HALF, PASS, BLOCK_PASS, PASS > 0)
        else:  # the tail past rot_dim is unchanged: no need to store it back
            _store_head(row, hmask, o1, o2, op, HALF, BLOCK_HALF, PASS, BLOCK_PASS, False)
    else:
        # int64: slot * stride overflows int32 on caches of a few GiB.
        slot = tl.load(slot_ptr + t).to(tl.int64)
        heads = (hb - num_q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        # Negative slots are CUDA-graph padding rows: nothing to read or write.
        hmask = heads < tl.where(slot >= 0, num_kv_heads, 0)
        row = k_ptr + t * stride_kt + heads[:, None] * stride_kh
        o1, o2, op = _norm_rope(row, hmask, cos, sin, kw_ptr, eps, BLOCK_H, HEAD_DIM, HALF,
                                BLOCK_HALF, PASS, BLOCK_PASS, K_NORM)
        dst = slot * stride_cs + heads[:, None] * stride_ch
        if KV_FP8:  # the key as rounded to the activation dtype, then quantized
            kdt = k_cache_ptr.dtype.element_ty
            _store_head(k_cache_ptr + dst, hmask, to_fp8(o1, k_scale, kdt),
                        to_fp8(o2, k_scale, kdt), to_fp8(op, k_scale, kdt), HALF, BLOCK_HALF,
                        PASS, BLOCK_PASS, PASS > 0)
        else:
            _store_head(k_cache_ptr + dst, hmask, o1, o2, op, HALF, BLOCK_HALF, PASS,
                        BLOCK_PASS, PASS > 0)
        offs_d = tl.arange(0, HEAD_DIM)[None, :]
        v = tl.load(v_ptr + t * stride_vt + heads[:, None] * stride_vh + offs_d,
                    mask=hmask[:, None])
        if KV_FP8:
            v = to_fp8(v, v_scale, v_cache_ptr.dtype.element_ty)
        tl.store(v_cache_ptr + dst + offs_d, v, mask=hmask[:, None])


def _check(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
           weights: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
    t, _, d = q.shape
    if k.dim() != 3 or k.shape[0] != t or k.shape[2] != d or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not "
                         "match")
    hk = k.shape[1]
    if kv_cache.dim() != 4 or kv_cache.shape[0] != 2 or tuple(kv_cache.shape[2:]) != (hk, d):
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} is not [2, slots, {hk}, {d}]")
    fp8 = check_fp8_cache(kv_cache, q.dtype)
    if not (q.dtype == k.dtype == v.dtype and (fp8 or kv_cache.dtype == q.dtype)) \
            or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q {q.dtype}, k {k.dtype}, v {v.dtype}, cache {kv_cache.dtype}: "
                         "need one of fp16/bf16/fp32 for all (the cache may be FP8)")
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32/int64 [{t}]")
    if slot_mapping.shape != (t,) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [{t}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must be [max_pos, rot_dim], contiguous rows")
    rot = cos_sin_cache.shape[1]
    if rot % 2 or rot > d:
        raise ValueError(f"rot_dim {rot} must be even and <= head dim {d}")
    if d & (d - 1):
        raise ValueError(f"head dim {d} is not a power of two")
    if any(x.stride(2) != 1 for x in (q, k, v)) or kv_cache.stride(3) != 1:
        raise ValueError("the head dim must be contiguous")
    if kv_cache.stride(1) != kv_cache.stride(2) * hk:
        raise ValueError("cache slots must be contiguous rows of Hk * D")
    for w in weights:
        if w is not None and (w.shape != (d,) or w.stride(0) != 1):
            raise ValueError(f"norm weight {tuple(w.shape)} must be contiguous [{d}]")


def rope_kv_write(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
                  k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                  k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """positions, slot_mapping: [T] int (slots < 0 are skipped); q: [T, Hq, D]; k, v:
    [T, Hk, D] (strided views of a fused qkv output are fine); cos_sin_cache: [max_pos,
    rot_dim] as in shoal.layers.rotary; kv_cache: [2, num_slots, Hk, D]; norm weights: [D]
    or None for no norm. q <- rope(norm(q)) in place; cache <- rope(norm(k)), v (an FP8
    cache: divided by k_scale, v_scale). k and v are not modified."""
    _check(positions, q, k, v, cos_sin_cache, kv_cache, slot_mapping,
           (q_norm_weight, k_norm_weight))
    t, hq, d = q.shape
    hk = k.shape[1]
    if t == 0:
        return
    half = cos_sin_cache.shape[1] // 2
    tail = d - 2 * half
    # About 1K elements per program: one to a few programs per token and kind.
    # One head-block width for q and k programs: the compiler needs the values both branches
    # of the kernel's q/k split define to have the same shapes.
    cap = max(1, 1024 // d)
    block_h = min(triton.next_power_of_2(max(hq, hk)), cap)
    num_q_blocks = triton.cdiv(hq, block_h)
    grid = (t, num_q_blocks + triton.cdiv(hk, block_h))
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    fp8 = kv_quant.is_fp8(kv_cache)
    _rope_kv_write_kernel[grid](
        q, k, v, k_cache, v_cache, positions, slot_mapping, cos_sin_cache,
        q_norm_weight if q_norm_weight is not None else q,
        k_norm_weight if k_norm_weight is not None else k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), cos_sin_cache.stride(0),
        hq, hk, num_q_blocks, eps, k_scale, v_scale,
        HEAD_DIM=d, HALF=half, BLOCK_HALF=triton.next_power_of_2(max(half, 1)), PASS=tail,
        BLOCK_PASS=triton.next_power_of_2(max(tail, 1)), BLOCK_H=block_h,
        Q_NORM=q_norm_weight is not None, K_NORM=k_norm_weight is not None, KV_FP8=fp8,
        num_warps=4, **pdl.kwargs(q.device),
    )


def rope_kv_write_reference(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                            v: torch.Tensor, cos_sin_cache: torch.Tensor,
                            kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                            q_norm_weight: torch.Tensor | None = None,
                            k_norm_weight: torch.Tensor | None = None,
                            eps: float = 1e-6, k_scale: float = 1.0,
                            v_scale: float = 1.0) -> None:
    """rope_kv_write in plain PyTorch, same arguments and effects (the test oracle)."""
    rot = cos_sin_cache.shape[1]
    half = rot // 2
    table = cos_sin_cache[positions].float().unsqueeze(1)  # [T, 1, rot]
    cos, sin = table[..., :half], table[..., half:]

    def norm(x: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
        if w is None:
            return x
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w

    def rope(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:rot].float()
        out = x.clone()
        out[..., :half] = x1 * cos - x2 * sin
        out[..., half:rot] = x2 * cos + x1 * sin
        return out

    q.copy_(rope(norm(q, q_norm_weight)))
    keys = rope(norm(k, k_norm_weight))
    if kv_quant.is_fp8(kv_cache):
        keys, v = kv_quant.quantize(keys, k_scale), kv_quant.quantize(v, v_scale)
    ok = slot_mapping >= 0
    kv_cache[0, slot_mapping[ok]] = keys[ok]
    kv_cache[1, slot_mapping[ok]] = v[ok]
