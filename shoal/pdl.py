"""Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may start while the
kernel before it in the stream is still finishing, and waits (griddepcontrol.wait) only where
it first reads what that kernel wrote.

A batch-1 decode step of an 8B model is ~320 kernels of 2-35 us (H200, FP8 weights: 3.08 ms
of kernels in a 3.16 ms graph replay). Each one ramps up from idle SMs and ends with a tail
of its last programs: at a few microseconds a kernel, a share of its time the SMs spend
waiting. With PDL the next kernel's programs are resident before the last ones of this
kernel finish, so its launch and its set-up overlap that tail.

Each kernel that takes part calls `grid_dependency(PDL)` before its first load (one with
early weights, below, calls its two halves around those loads): it lets the next kernel
launch (griddepcontrol.launch_dependents) and then waits for the one before
(griddepcontrol.wait: that kernel finished and its writes are visible). A kernel launched
with PDL must wait before it reads anything an earlier kernel wrote: before the wait it reads
only what no launch of the chain before it wrote (the early reads below). Waiting covers
every kernel before it, not only the last: that one finished only after its own wait
returned. A kernel launched without it (torch ops, cuBLAS) waits for the one before to
finish, as ever.

Taking part: RMSNorm (rms_norm.py), SiLU-mul, the FP8 GEMV (decode_gemv.py), the INT4
tensor-core GEMV (int4_mma_gemv.py; it lets the next kernel in after its K loop, not first),
the dense bf16 GEMVs (half_gemv.py) and their split sum, rope and cache write, paged decode and
its split reduce, and the hybrid and MoE decode kernels (sigmoid gate, conv step, delta rule,
fused linear decode, gate routing, half-decode experts). Early weights: the FP8 GEMV at one row
with per-channel scales (decode_gemv.py EARLY) and the prefetching bf16 GEMV tile load their
first K step's weights before they wait, and the MoE gate routing (gate_routing.py) its first
hidden chunk of the gate (at H <= 2048 a warp, all of it) and the linear layers' conv step its
taps, so the read starts in the tail of the kernel before. Early states: a decode step's linear
layers (linear_decode_fused.py and the conv step) read their block ids and their recurrent
states (the conv windows, the delta rule's state tile) before they wait. Safe because no kernel
of a step writes weights: a weight update (RL, LoRA loads) runs between steps, and kernels that
wait lie between it and the kernel reading early. A decode step's states are written only by
the kernel that reads them and by torch ops (a speculative step's fold just before, prefill
chunks, tier restores; torch ops are not launched with PDL, so a kernel after one starts only
once it has finished), the previous step's writes are finished (a graph replay, or such a torch
op, lies between), and the block ids come from a host-to-device copy before the step's first
kernel (layers/linear_attention.py EARLY_READS).

Measured (back to back on one GPU each time, W2 batch 1 unless named):
- H200, 2026-12-07, Llama-3.1-8B shape, the first set (norms, FP8 GEMV, rope, attention,
  SiLU-mul): FP8 weights 334.3 -> 353.0 tok/s, bf16 (cuBLAS GEMMs between them) 221.1 ->
  223.4.
- H100, 2026-12-07, the rest on top of that set: FP8 early weights 291.2 -> 299.2 tok/s; bf16
  with the dense GEMVs 175.2 -> 179.5 (cuBLAS without PDL: 171.7); Qwen3.5-35B-A3B batch 1
  295.8 -> 307.4 with the hybrid/MoE kernels, 316.3 with the dense GEMVs too.
- H100, 2026-12-07 (session 21): the gate routing's early gate weights, Qwen3.5-35B-A3B batch 1
  316.5 -> 319.3 tok/s (graph step 3.160 -> 3.132 ms); then the conv step's early taps 319.6 ->
  320.4 (3.129 -> 3.121 ms: one engine each way, whose three runs spread about as far as
  the gain: within the noise).
- H100, 2026-12-07 (session 22): the linear layers' early states (and their two reductions
  side by side), Qwen3.5-35B-A3B batch 1 315.7 -> 319.3 tok/s (graph step 3.168 -> 3.132
  ms, the same first 32 tokens); per layer in a CUDA graph, projections included, 34.0 us
  against 35.2 with the states read after the wait.
- H100, 2026-12-07 (session 24): the INT4 tensor-core GEMV (int4_mma_gemv.py), W2 batch 1
  INT4 g128 306.6 -> 317.7 tok/s (step 3.261 -> 3.148 ms, the same first 32 tokens;
  SHOAL_INT4_PDL). It lets the next kernel in only after its K loop, not at its start
  (launch_dependents takes effect once every program has issued it or exited): the next
  kernel launches once every program has finished its loads and dots, so its start
  overlaps this kernel's stores and split sums. Why that beats the start is not measured.
Not the other INT4 GEMVs (the strip and wide kernels): with PDL at their start INT4 fell
326.2 -> 295.9 (H200, session 19, the strip kernel; with only the kernels around them taking
part: 318.9, within the launch tuner's run-to-run choices).

`launch(device)`: whether a launch on `device` takes part (SHOAL_PDL=1, the default; CUDA,
sm_90+, a Triton with griddepcontrol); `kwargs(device)` the launch's extra arguments then (the
kernel's PDL constexpr and `launch_pdl`), none otherwise: off (SHOAL_PDL=0), a launch is the
one it was without PDL (same compiled kernel). The interpreter (no inline PTX) and the CPU
never see it.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from shoal import envs

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except ImportError:  # an older Triton: PDL stays off, the stubs below are never traced
    HAVE_GDC = False

    @triton.jit
    def gdc_launch_dependents():
        pass

    @triton.jit
    def gdc_wait():
        pass


@triton.jit
def launch_next(PDL: tl.constexpr):
    """Lets the next kernel launch (PDL only)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """Waits for the kernel before (PDL only): from here on it is finished, its writes seen."""
    if PDL:
        gdc_wait()


@triton.jit
def grid_dependency(PDL: tl.constexpr):
    """Lets the next kernel launch, then waits for the one before: a kernel's first line
    (one that reads weights before it waits calls the two halves itself)."""
    launch_next(PDL)
    wait_previous(PDL)


@functools.cache
def _capable(index: int) -> bool:
    """An NVIDIA GPU of sm_90 or later (ROCm's devices are "cuda" to torch too)."""
    return HAVE_GDC and torch.version.hip is None and \
        torch.cuda.get_device_capability(index)[0] >= 9


def launch(device: torch.device) -> bool:
    """Whether kernels launched on `device` use PDL (see the module's doc; never under
    TRITON_INTERPRET, which runs CUDA tensors' kernels too and has no griddepcontrol)."""
    if (device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
            or not envs.SHOAL_PDL.get()):
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def kwargs(device: torch.device) -> dict[str, bool]:
    """The extra launch arguments of a kernel taking part (see the module's doc)."""
    return {"PDL": True, "launch_pdl": True} if launch(device) else {}
