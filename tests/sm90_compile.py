"""Compiles Triton kernels for sm_90 (Hopper) on a machine without a GPU: Triton's front end,
its passes and ptxas, no driver. The CPU suite runs kernels in Triton's interpreter, which
checks what a kernel computes but not that Triton's compiler takes it: a name rebound to
another shape inside a branch, say, passes the interpreter and fails at the first launch on
a GPU (session 21: the gate routing's early weights cost a GPU call that way). The
interpreter also never takes the branches a GPU launch takes: PDL is off there (shoal/pdl.py)
and kernels round through interpreted_half under INTERPRETED.

Two halves:
- recording: with SHOAL_RECORD_TRITON_LAUNCHES=<file> in a pytest process, conftest.py calls
  `start_recording(file)`: every interpreted launch of one of shoal's kernels appends one
  JSON line (the kernel's module and name, each argument's Triton type or constexpr value,
  the launch options), or a `dropped` line where an argument has no description (a failure
  of the compile half);
- `compile_recorded(file)` -> (launches compiled, failures): in a process without
  TRITON_INTERPRET (`python tests/sm90_compile.py FILE`), the launches that together show
  every constexpr value and launch option each kernel was recorded with (the first launch
  of a kernel, then each one that adds a value), compiled for sm_90 as a GPU launches them:
  PDL on and INTERPRETED off where the kernel takes them, an integer argument of 1 a
  constant and pointers and integers a multiple of 16 marked so (except where the kernel
  does not specialize on them), as Triton's launcher does.

`sass_of_records(records)` compiles launches described the same way and returns their
machine code (nvdisasm), registers and spills, for tests that check what ptxas made of a
loop (tests/quantization/test_int4_mma_sass.py).

Limits: the shapes are the tests', not a model's (register spills and shared-memory limits at
real sizes show only on a GPU), and the compiler is this machine's Triton, which may be
newer than the GPU machine's.
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
        return {"ptr": _TL_TYPES[str(value.dtype).removeprefix("torch.")],  # (KeyError: none)
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
                    "div16": value % 16 == 0, "one": value == 1}
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
        record: dict[str, Any] = {"module": fn.__module__, "name": fn.__name__}
        try:
            constexprs = _constexpr_names(fn)
            record["args"] = {k: _describe(v, k in constexprs) for k, v in params.items()}
            record["options"] = {k: v for k, v in options.items()
                                 if isinstance(v, (bool, int, float))}
        except (TypeError, KeyError) as e:  # (reported as a failure by the compile half)
            record = {**record, "dropped": f"{type(e).__name__}: {e}"}
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
        elif d.get("one") and not p.do_not_specialize:  # (the launcher's constant 1)
            sig[name], const[name] = "constexpr", 1
        elif "type" in d:
            sig[name] = d["type"]
        elif "tl_dtype" in d:
            raise TypeError(f"{name}: a tl.dtype passed as a runtime argument")
        else:  # None (Triton makes it a constexpr) or a string
            sig[name], const[name] = "constexpr", d["value"]
    return sig, const


def compile_one(record: dict[str, Any]) -> Any:
    """Compiles one recorded launch for sm_90 (raises what Triton raises): the compiled
    kernel."""
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
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(kernel.params)
             if record["args"].get(p.name, {}).get("div16") and sig[p.name] != "constexpr"
             and not p.do_not_specialize and not p.do_not_specialize_on_alignment}
    src = ASTSource(fn=kernel, signature=sig, constexprs=const, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def sass_of(record: dict[str, Any]) -> dict[str, Any]:
    """One launch compiled for sm_90 as its machine code: {"sass": nvdisasm's listing,
    "registers", "local" (bytes a thread spills), "shared"}, from the tools Triton ships."""
    import re
    import tempfile

    import triton

    cubin = compile_one(record).asm["cubin"]
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(cubin)
        listing = subprocess.run([str(tools / "nvdisasm"), "-c", str(path)], check=True,
                                 capture_output=True, text=True).stdout
        usage = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(path)],
                               check=True, capture_output=True, text=True).stdout
    found = dict(re.findall(r"(REG|LOCAL|SHARED):(\d+)", usage))
    return {"sass": listing, "registers": int(found.get("REG", 0)),
            "local": int(found.get("LOCAL", 0)), "shared": int(found.get("SHARED", 0))}


def sass_of_records(records: list[dict[str, Any]], timeout: float = 300) -> list[dict[str, Any]]:
    """sass_of for each record, in a process of its own without the interpreter (as
    compile_recorded)."""
    import tempfile

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(records, f)
        f.flush()
        done = subprocess.run([sys.executable, __file__, "--sass", f.name], env=env,
                              timeout=timeout, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the sm_90 compile process failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def compile_recorded(path: str | Path, timeout: float = 540) -> tuple[int, list[str]]:
    """(launches compiled, failures as 'module.name: error') of a recording (see the module
    docstring), compiled in a process of its own without the interpreter, two at a time
    (~0.6-2.5 s a launch here with a cold Triton cache)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__, str(path)], env=env, timeout=timeout,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the sm_90 compile process failed:\n{done.stderr[-4000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return out["launches"], out["failures"]


def covering(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per kernel, its first record, then each one that adds a constexpr value, a launch
    option or an integer argument of 1 not yet seen (in sorted order): every value a test ran
    is compiled at least once, without compiling every combination."""
    seen: dict[tuple[str, str], set[str]] = {}
    keep = []
    for r in records:
        values = {json.dumps([k, v], sort_keys=True) for k, v in r["args"].items()
                  if "value" in v or "tl_dtype" in v or v.get("one")}
        values |= {json.dumps(["option", k, v]) for k, v in r["options"].items()}
        have = seen.setdefault((r["module"], r["name"]), set())
        if not have or values - have:
            keep.append(r)
            have |= values
    return keep


def _compile_or_error(record: dict[str, Any]) -> str | None:
    try:
        compile_one(record)
    except Exception as e:  # noqa: BLE001 (each failure is reported, the rest go on)
        last = str(e).strip().splitlines()[-1] if str(e).strip() else ""
        return f"{record['module']}.{record['name']}: {type(e).__name__}: {last[:300]}"
    return None


def _main(path: str) -> None:
    from concurrent.futures import ProcessPoolExecutor

    records = [json.loads(line) for line in sorted(set(Path(path).read_text().splitlines()))]
    failures = [f"{r['module']}.{r['name']}: not recorded: {r['dropped']}"
                for r in records if "dropped" in r]
    chosen = covering([r for r in records if "dropped" not in r])
    with ProcessPoolExecutor(max_workers=2) as pool:
        failures += [f for f in pool.map(_compile_or_error, chosen) if f is not None]
    print(json.dumps({"launches": len(chosen), "failures": failures}))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("run without TRITON_INTERPRET: this compiles for a GPU")
    if sys.argv[1] == "--sass":
        print(json.dumps([sass_of(r) for r in json.loads(Path(sys.argv[2]).read_text())]))
    else:
        _main(sys.argv[1])
