"""Compiles Triton kernels for sm_90 (Hopper) on a machine without a GPU: Triton's front end,
its passes and ptxas, no driver. The CPU suite runs kernels in Triton's interpreter, which
checks what a kernel computes but not that Triton's compiler takes it: a name rebound to
another shape inside a branch, say, passes the interpreter and fails at the first launch on
a GPU (session 21: the gate routing's early weights cost a GPU call that way). The
interpreter also never takes the branches a GPU launch takes: PDL is off there (shoal/pdl.py)
and kernels round through interpreted_half under INTERPRETED.

Two halves:
- recording: with SHOAL_RECORD_TRITON_LAUNCHES=<file> in a pytest process, conftest.py calls
  `start_recording(file)`: every interpreted launch appends one JSON line (the kernel's module
  and name, each argument's Triton type or constexpr value, the launch options);
- `compile_recorded(file)`: each distinct launch compiled for sm_90 as a GPU would launch it
  (PDL on and INTERPRETED off where the kernel takes them), in a process without
  TRITON_INTERPRET (`python tests/sm90_compile.py FILE`); returns the failures.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

# torch dtype name -> Triton's pointer element type
_TL_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
             "int64": "i64", "int32": "i32", "int16": "i16", "int8": "i8", "uint8": "u8",
             "bool": "i1", "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}
# what a GPU launch sets where the interpreter set the other value
_GPU_CONSTEXPRS = {"PDL": True, "INTERPRETED": False}


def _describe(value: Any, constexpr: bool) -> dict[str, Any]:
    """One argument as JSON: a tensor's pointer type, a constexpr's value (a tl.dtype by
    name), a runtime scalar's type only (its value does not change the compiled kernel: one
    record for every hidden size a test tries)."""
    import torch
    import triton.language as tl

    if isinstance(value, torch.Tensor):  # (div16: as the GPU's launch specializes it)
        return {"ptr": _TL_TYPES[str(value.dtype).removeprefix("torch.")],
                "div16": value.data_ptr() % 16 == 0}
    if isinstance(value, tl.dtype):
        return {"tl_dtype": value.name}
    if isinstance(value, tl.constexpr):
        return _describe(value.value, constexpr)
    if value is None or isinstance(value, (bool, int, float, str)):
        if constexpr or value is None or isinstance(value, str):
            return {"value": value}
        if isinstance(value, bool):
            return {"type": "i1"}
        if isinstance(value, int):
            return {"type": "i32" if -2**31 <= value < 2**31 else "i64",
                    "div16": value % 16 == 0}
        return {"type": "fp32"}
    raise TypeError(f"no description for a {type(value).__name__} argument")


def _constexpr_names(fn: Any) -> set[str]:
    """The parameters annotated tl.constexpr (a string under postponed annotations)."""
    import inspect

    return {p.name for p in inspect.signature(fn).parameters.values()
            if "constexpr" in str(p.annotation)}


def start_recording(path: str | Path) -> None:
    """Every interpreted launch in this process appended to `path` (one JSON line each)."""
    from triton.runtime.interpreter import InterpretedFunction

    original = InterpretedFunction.run

    def run(self: Any, *args: Any, grid: Any, warmup: Any, **kwargs: Any) -> Any:
        fn = self.fn
        if not fn.__module__.startswith("shoal."):  # (a test's own kernel: not importable)
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)
        names = list(self.arg_names)
        params = {**dict(zip(names, args)), **{k: v for k, v in kwargs.items() if k in names}}
        options = {k: v for k, v in kwargs.items() if k not in names}
        try:
            constexprs = _constexpr_names(fn)
            record = {"module": fn.__module__, "name": fn.__name__,
                      "args": {k: _describe(v, k in constexprs) for k, v in params.items()},
                      "options": {k: v for k, v in options.items()
                                  if isinstance(v, (bool, int, float))}}
        except TypeError:
            record = None  # (an argument this recorder cannot describe: not compiled)
        if record is not None:
            with open(path, "a") as f:
                f.write(json.dumps(record, sort_keys=True) + "\n")
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run


def _signature(kernel: Any, args: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
    """(Triton signature, constexprs) of a recorded launch, as a GPU launches it."""
    import triton.language as tl

    sig, const = {}, {}
    for p in kernel.params:
        name = p.name
        if p.is_constexpr:
            sig[name] = "constexpr"
            if name in _GPU_CONSTEXPRS:
                const[name] = _GPU_CONSTEXPRS[name]
            elif name in args:
                d = args[name]
                const[name] = tl.dtype(d["tl_dtype"]) if "tl_dtype" in d else d["value"]
            else:
                const[name] = p.default
            continue
        d = args[name]
        if "ptr" in d:
            sig[name] = "*" + d["ptr"]
        elif "type" in d:
            sig[name] = d["type"]
        elif "tl_dtype" in d:
            raise TypeError(f"{name}: a tl.dtype passed as a runtime argument")
        else:  # None (Triton makes it a constexpr) or a string
            sig[name], const[name] = "constexpr", d["value"]
    return sig, const


def compile_one(record: dict[str, Any]) -> None:
    """Compiles one recorded launch for sm_90 (raises what Triton raises)."""
    import dataclasses

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDAOptions
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(record["module"]), record["name"])
    sig, const = _signature(kernel, record["args"])
    fields = {f.name for f in dataclasses.fields(CUDAOptions)} - {"launch_pdl"}
    options = {k: v for k, v in record["options"].items() if k in fields}
    # pointers and integers a multiple of 16, as the launch tells the compiler (vector loads)
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names)
             if record["args"].get(name, {}).get("div16") and sig[name] != "constexpr"}
    src = ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs)
    triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_recorded(path: str | Path, per_kernel: int = 4, timeout: float = 600
                     ) -> tuple[int, list[str]]:
    """(launches compiled, failures as 'module.name: error') of a recording: up to per_kernel
    distinct launches of each kernel, compiled in a process of its own without the
    interpreter (~0.6 s each here with a cold Triton cache)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__, str(path), str(per_kernel)], env=env,
                          timeout=timeout,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the sm_90 compile process failed:\n{done.stderr[-4000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out["launches"], out["failures"]


def _main(path: str, per_kernel: int) -> None:
    by_kernel: dict[tuple[str, str], list[str]] = {}
    for line in sorted(set(Path(path).read_text().splitlines())):
        record = json.loads(line)
        by_kernel.setdefault((record["module"], record["name"]), []).append(line)
    # at most per_kernel launches a kernel, spread over its recorded ones (sorted: varied
    # constexprs, not only the first few shapes of one test)
    lines = [ls[round(i * (len(ls) - 1) / max(per_kernel - 1, 1))] if len(ls) > per_kernel
             else ls[i] for ls in by_kernel.values() for i in range(min(per_kernel, len(ls)))]
    failures = []
    for line in lines:
        record = json.loads(line)
        try:
            compile_one(record)
        except Exception as e:  # noqa: BLE001 (each failure is reported, the rest go on)
            first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            failures.append(f"{record['module']}.{record['name']}: {type(e).__name__}: "
                            f"{first[:300]}")
    print(json.dumps({"launches": len(lines), "failures": failures}))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run without TRITON_INTERPRET: this compiles for a GPU")
    _main(sys.argv[1], int(sys.argv[2]))
