"""Programmatic dependent launch (PDL, sm_90+): a kernel launched with it may start while the
kernel before it in the stream is still finishing, and waits (griddepcontrol.wait) only where
it first reads what that kernel wrote.

A batch-1 decode step of an 8B model is ~320 kernels of 2-35 us (H200, FP8 weights: 3.08 ms
of kernels in a 3.16 ms graph replay). Each one ramps up from idle SMs and ends with a tail
of its last programs: at a few microseconds a kernel, a share of its time the SMs spend
waiting. With PDL the next kernel's programs are resident before the last ones of this
kernel finish, so its launch and its set-up overlap that tail.

Each kernel that takes part calls `grid_dependency(PDL)` before its first load: it lets the
next kernel launch (griddepcontrol.launch_dependents) and then waits for the one before
(griddepcontrol.wait: that kernel finished and its writes are visible). A kernel launched
with PDL must wait before it reads anything an earlier kernel wrote: before the wait it
reads nothing (but the FP8 GEMV's early weights on trial, below). Waiting covers every kernel before it, not only the last: that one
finished only after its own wait returned. A kernel launched without it (torch ops, cuBLAS)
waits for the one before to finish, as ever.

Taking part: RMSNorm (rms_norm.py), SiLU-mul, the FP8 GEMV (decode_gemv.py), rope and cache
write, paged decode and its split reduce. On an H200 (2026-12-07, Llama-3.1-8B shape, W2 batch
1, twice each): FP8 weights 334.3 -> 353.0 tok/s, bf16 (cuBLAS GEMMs between them) 221.1 ->
223.4. Not the INT4 GEMVs: their kernels are bound by instructions, not bytes (decode_gemv.py),
and with PDL INT4 fell 326.2 -> 295.9 (with only the kernels around them taking part: 318.9,
within the launch tuner's run-to-run choices).

On trial (SHOAL_PDL=all; `kwargs(device, trial=True)`): the decode kernels of the hybrid
and MoE models and the opt-in dense GEMVs (TRIAL), which take part the same way but have not been measured with it: a
kernel bound by instructions can lose (the INT4 GEMVs), so they join the default once a GPU
run says they gain.

`launch(device)`: whether a launch on `device` takes part (SHOAL_PDL "1", the default, or
"all"; CUDA, sm_90+, a Triton with griddepcontrol); `kwargs(device)` the launch's extra
arguments then (the kernel's PDL constexpr and `launch_pdl`), none otherwise: off, a launch is
the one it was without PDL (same compiled kernel). The interpreter (no inline PTX) and the CPU
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


# The kernels that take part only with SHOAL_PDL=all (their launches pass trial=True), and
# the FP8 GEMV's early weights: at one row with per-channel scales its first K step's weights
# load before it waits, so the read starts in the tail of the kernel before (decode_gemv.py
# EARLY). Safe because no kernel of a step writes weights: a weight update (RL, LoRA loads)
# runs between steps, and kernels that wait lie between it and the GEMV
TRIAL = ("sigmoid_gate", "conv_step", "delta_rule", "linear_decode_fused", "gate_routing",
         "half_decode_experts", "fp8_gemv early weights", "half_gemv (SHOAL_DENSE_GEMV=1)")


def launch(device: torch.device, trial: bool = False) -> bool:
    """Whether kernels launched on `device` use PDL (see the module's doc; never under
    TRITON_INTERPRET, which runs CUDA tensors' kernels too and has no griddepcontrol).
    trial: a kernel of TRIAL."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    mode = envs.SHOAL_PDL.get()
    if mode == "0" or (trial and mode != "all"):
        return False
    return _capable(device.index if device.index is not None else torch.cuda.current_device())


def kwargs(device: torch.device, trial: bool = False) -> dict[str, bool]:
    """The extra launch arguments of a kernel taking part (see the module's doc)."""
    return {"PDL": True, "launch_pdl": True} if launch(device, trial) else {}
