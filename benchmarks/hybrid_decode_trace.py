"""What one decode step of a linear-attention layer (Kimi Delta Attention, Gated DeltaNet) asks
of a CUDA device, traced on the CPU (issue 30: a KDA layer's non-GEMM decode work was ~29
kernels and ~47 us on the H100): every aten op and Triton launch of the layer's forward, in
order, with the GEMMs of its projections marked.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/hybrid_decode_trace.py \
        [--batch 1] [--dtype bfloat16] [--out FILE.json]

The layers are built at a tiny width (4 value heads of 16, hidden 32: the op sequence does not
depend on the width) and bound to a paged cache. The CUDA decode path is forced onto CPU
tensors (shoal.layers.linear_attention.triton_decode, the seam the tests use) with Triton's
interpreter running its kernels, so the trace is the GPU's sequence: each aten op that is not
a view is about one kernel launch there, each Triton launch exactly one. Two paths a layer:
"fused" (the default on CUDA for a step of decodes only: linear_decode_fused.py) and
"in_place" (the older path: the two in-place kernels of linear_state_decode.py and the torch
ops around them, what a step that mixes decodes with prefill chunks still runs)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hybrid_prefill_trace import _is_view  # noqa: E402

NO_LAUNCH = ("empty", "empty_like", "empty_strided", "lift_fresh", "detach_",
             "_local_scalar_dense", "split_with_sizes")  # (views and allocations)
LINEAR_TYPES = ("ColumnParallelLinear", "RowParallelLinear", "ReplicatedLinear",
                "SegmentedColumnLinear", "MergedColumnParallelLinear")
BS, PLANES, HK_PAGE, D_PAGE = 16, 2, 2, 32


class LaunchTrace(TorchDispatchMode):
    """The ordered aten ops (not views, not allocations) and Triton launches of a forward;
    ops inside a linear projection collapse into one GEMM entry."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []
        self.inside: list[str] = []  # the projection (or Triton launch) being run
        self.gemm_ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        base = name.split(".")[0]
        if self.inside:
            if self.inside[-1].startswith("gemm:"):
                self.gemm_ops.append(base)
            return out
        if (_is_view(name) or base in NO_LAUNCH
                or (base in ("to", "_to_copy", "contiguous") and args and out is args[0])):
            return out
        self.events.append(base)
        return out


@contextmanager
def traced(layer: nn.Module, trace: LaunchTrace, kernel_modules: list[Any]):
    """GEMMs by module hooks; each Triton kernel of kernel_modules wrapped to log its launch
    (and hide the interpreter's own tensor ops)."""
    handles = []
    for name, mod in layer.named_modules():
        if type(mod).__name__ in LINEAR_TYPES:
            handles.append(mod.register_forward_pre_hook(
                lambda m, a, n=name: (trace.events.append(f"GEMM {n}"),
                                      trace.inside.append(f"gemm:{n}")) and None))
            handles.append(mod.register_forward_hook(
                lambda m, a, o: trace.inside.pop() and None))
    saved = []
    for module in kernel_modules:
        for attr in dir(module):
            kern = getattr(module, attr)
            if attr.startswith("_") and attr.endswith("_kernel") and hasattr(kern, "__getitem__"):
                saved.append((module, attr, kern))
                setattr(module, attr, _LoggedKernel(kern, attr, trace))
    try:
        yield
    finally:
        for module, attr, kern in saved:
            setattr(module, attr, kern)
        for h in handles:
            h.remove()


class _LoggedKernel:
    def __init__(self, kernel: Any, name: str, trace: LaunchTrace):
        self.kernel, self.name, self.trace = kernel, name, trace

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.trace.events.append(f"TRITON {self.name}")
            self.trace.inside.append("triton")
            try:
                return launch(*args, **kwargs)
            finally:
                self.trace.inside.pop()
        return run


def tiny_layer(kind: str, dtype: torch.dtype, blocks: int) -> nn.Module:
    from shoal.layers.gated_delta_net import GatedDeltaNet
    from shoal.layers.kimi_delta_attention import KimiDeltaAttention

    cfg = SimpleNamespace(hidden_size=32, rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
                          linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=16, linear_value_head_dim=16,
                          linear_num_heads=4, linear_head_dim=16)
    layer = (KimiDeltaAttention(cfg, dtype) if kind == "kda"
             else GatedDeltaNet(cfg, dtype, interleaved=kind == "gdn-interleaved"))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    layer.bind_pages(torch.zeros(PLANES, blocks * BS, HK_PAGE, D_PAGE), BS)  # (float32 words)
    return layer


def trace_decode(kind: str, path: str, batch: int, dtype: torch.dtype) -> dict[str, Any]:
    from shoal.attention.linear_state import StateMetadata
    from shoal.layers import linear_attention
    from shoal.layers.ops import linear_decode_fused, linear_state_decode

    layer = tiny_layer(kind, dtype, blocks=batch + 1)
    md = StateMetadata(batch, torch.arange(1, batch + 1), torch.arange(1, batch + 1), [], BS)
    hidden = torch.randn(batch, 32).to(dtype)
    real_fused = linear_attention.fused_decode_enabled
    linear_attention.triton_decode = lambda x: True
    linear_attention.fused_decode_enabled = lambda: path == "fused" and real_fused()
    trace = LaunchTrace()
    try:
        with torch.no_grad(), traced(layer, trace, [linear_decode_fused, linear_state_decode]):
            with trace:
                layer(hidden, md)
    finally:
        linear_attention.triton_decode = _default_seam
        linear_attention.fused_decode_enabled = real_fused
    ev = trace.events
    gemms = [i for i, e in enumerate(ev) if e.startswith("GEMM")]
    between = ev[gemms[0]:gemms[-1] + 1]
    launches = [e for e in between if not e.startswith("GEMM")]
    return {"layer": kind, "path": path, "batch": batch, "dtype": str(dtype).split(".")[-1],
            "launches_between_gemms": len(launches), "gemms": len(gemms),
            "sequence": between}


_default_seam: Any = None


def main() -> int:
    global _default_seam
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from shoal.layers import linear_attention

    _default_seam = linear_attention.triton_decode
    res = []
    for kind in ("kda", "gdn", "gdn-interleaved"):
        for path in ("in_place", "fused"):
            rec = trace_decode(kind, path, args.batch, getattr(torch, args.dtype))
            print(f"{kind} {path}: {rec['launches_between_gemms']} launches between the first "
                  f"and last GEMM ({rec['gemms']} GEMMs)")
            for e in rec["sequence"]:
                print("   ", e)
            res.append(rec)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
