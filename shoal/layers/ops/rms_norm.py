"""RMSNorm, optionally fused with the residual add, one row per program.

Rounding follows shoal.layers.norm.RMSNorm (and HF Llama) exactly: the residual sum is rounded
to the activation dtype, the normalized row is rounded before the weight multiply."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal import pdl


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    stride_x, stride_r, stride_o, stride_ro, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False,
):
    pdl.grid_dependency(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    y = (xf * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
            out: torch.Tensor, res_out: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x {tuple(x.shape)} must be [T, H] with weight [H], got "
                         f"{tuple(weight.shape)}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"unsupported dtype {x.dtype}")
    for name, t in (("x", x), ("residual", residual), ("out", out), ("weight", weight)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along the hidden dim")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {residual.dtype} {tuple(residual.shape)} does not match x")
    n, h = x.shape
    if n == 0:
        return
    block = triton.next_power_of_2(h)
    if block > 65536:
        raise ValueError(f"hidden size {h} too large for a one-block row")
    num_warps = 4 if block <= 1024 else 8 if block <= 4096 else 16
    res = residual if residual is not None else x
    ro = res_out if res_out is not None else out
    _rms_norm_kernel[(n,)](
        x, res, weight, out, ro,
        x.stride(0), res.stride(0), out.stride(0), ro.stride(0), h, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps,
        **pdl.kwargs(x.device),
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, H] -> RMSNorm(x) * weight in x's dtype, into `out` (new tensor by default; x
    is left alone because the caller usually keeps it as the residual)."""
    if out is None:
        out = torch.empty_like(x)
    elif out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError("out must match x")
    _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: residual <- x + residual, x <- RMSNorm(residual) * weight. Returns
    (x, residual), i.e. (normed, new residual) like RMSNorm.forward(x, residual). x and
    residual must not overlap."""
    if x.data_ptr() == residual.data_ptr():
        raise ValueError("x and residual must be distinct buffers")
    _launch(x, residual, weight, eps, x, residual)
    return x, residual
