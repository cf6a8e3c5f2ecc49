"""A MoE router's logits at decode sizes in one Triton launch: float32 x @ W^T, reading the
activations in their own dtype and the gate weight in its own (float32 where the checkpoint
keeps it so, as DeepSeek's and Kimi's do).

The torch form is a cast of x to float32 and cuBLAS's float32 GEMV, which at one token runs as
a dot kernel and a reduce kernel: three launches, about 6 us a MoE layer on the H100 for a
read of 0.5 MB (DeepSeek-V2-Lite's 64 x 2048 gate), against about 2 us for one launch. At
more than MAX_TOKENS tokens each program's re-reads of its weight rows outgrow what one launch
saves, and cuBLAS's GEMM runs.

Each program computes BLOCK_E experts' logits of one token, accumulating in float32 in
BLOCK_H-wide partial sums; the order differs from cuBLAS's, so logits agree to float32
rounding (a top-k at an exact tie may pick the other expert, as between two GEMM
libraries)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TOKENS = 8
BLOCK_E = 2  # 32 programs for 64 experts: enough loads in flight for a 0.5 MB read
BLOCK_H = 1024


@triton.jit
def _gate_logits_kernel(x_ptr, w_ptr, out_ptr, stride_xt, stride_we, stride_ot, num_experts,
                        hidden, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(1).to(tl.int64)
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    emask = experts < num_experts
    acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
    for h0 in range(0, hidden, BLOCK_H):
        offs = h0 + tl.arange(0, BLOCK_H)
        hmask = offs < hidden
        x = tl.load(x_ptr + t * stride_xt + offs, mask=hmask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + experts[:, None].to(tl.int64) * stride_we + offs[None, :],
                    mask=emask[:, None] & hmask[None, :], other=0.0).to(tl.float32)
        acc += w * x[None, :]
    tl.store(out_ptr + t * stride_ot + experts, tl.sum(acc, 1), mask=emask)


def fits_gate_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """A decode-sized step the kernel takes: [T <= MAX_TOKENS, H] rows against [E, H]."""
    return (x.dim() == 2 and 0 < x.shape[0] <= MAX_TOKENS and weight.dim() == 2
            and weight.shape[1] == x.shape[1] and x.stride(1) == 1 and weight.stride(1) == 1
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and weight.dtype in (torch.float32, torch.bfloat16, torch.float16))


def gate_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [T, H], weight [E, H] -> float32 logits [T, E] (x and the weight widened to float32,
    as F.linear(x.float(), weight.float()))."""
    if not fits_gate_kernel(x, weight):
        raise ValueError(f"gate_logits takes x [T <= {MAX_TOKENS}, H] and weight [E, H], both "
                         f"contiguous along H in fp32/bf16/fp16; got x {tuple(x.shape)} "
                         f"{x.dtype}, weight {tuple(weight.shape)} {weight.dtype}")
    t, hidden = x.shape
    e = weight.shape[0]
    out = torch.empty(t, e, dtype=torch.float32, device=x.device)
    _gate_logits_kernel[(triton.cdiv(e, BLOCK_E), t)](
        x, weight, out, x.stride(0), weight.stride(0), out.stride(0), e, hidden,
        BLOCK_E=BLOCK_E, BLOCK_H=BLOCK_H, num_warps=4)
    return out
