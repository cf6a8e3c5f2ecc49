"""shoal's C++ CPU kernels (shoal/csrc): build, load, and whether this process may use them.

One torch extension holds them all (namespace torch.ops.shoal_cpu): the paged decode attention
(used by shoal/attention/ops/cpu_paged_decode.py), the decoder layer's small ops
(shoal/layers/ops/cpu_layer_ops.py) and linear attention's decode step
(shoal/layers/ops/cpu_linear_state.py). Built ahead of time by `python -m shoal.cpu_kernels
--build` (the Makefile's set-up runs it), never inside a request: a compile takes about a
minute on a laptop-class CPU. At run time the kernels are used when the build of these very
sources, torch and flags exists (the build folder is named by their hash, so a stale build is
never loaded); otherwise callers keep their torch paths and one log line says why.

SHOAL_EXTENSIONS_DIR moves the build folder (default: csrc/build beside the sources,
git-ignored). Each family of kernels has its own off switch for A/B runs (see its module); the
variables are listed in shoal/envs.py."""

from __future__ import annotations

import argparse
import functools
import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

from shoal import envs

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (CSRC / "paged_decode_cpu.cpp", CSRC / "layer_ops_cpu.cpp", CSRC / "sampling_cpu.cpp",
           CSRC / "small_linear_cpu.cpp", CSRC / "linear_state_cpu.cpp")
HEADERS = (CSRC / "cpu_common.h",)
NAME = "shoal_cpu_kernels"
# No -march: one build must run on any x86-64; the kernels pick AVX-512/AVX2 at run time.
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)
DEFAULT_ROOT = CSRC / "build"


def build_dir() -> Path:
    root = envs.SHOAL_EXTENSIONS_DIR.get()
    return (Path(root) if root else DEFAULT_ROOT) / f"{NAME}-{_fingerprint()}"


def library_path() -> Path:
    return build_dir() / f"{NAME}.so"


@functools.cache
def _fingerprint() -> str:
    h = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        h.update(path.read_bytes())
    h.update(f"{torch.__version__}|{sys.version_info[:2]}|{CFLAGS}|{LDFLAGS}".encode())
    return h.hexdigest()[:16]


def missing_toolchain() -> str | None:
    """What the build needs and this machine lacks (a C++ compiler, ninja), or None."""
    from torch.utils.cpp_extension import is_ninja_available

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx})"
    if not is_ninja_available():
        return "no ninja"
    return None


def build(verbose: bool = False) -> Path:
    """Compiles the kernels (ninja skips an up-to-date build) and loads them; returns the
    library. Raises if the toolchain is missing or the compile fails."""
    from torch.utils.cpp_extension import load

    missing = missing_toolchain()
    if missing:
        raise RuntimeError(f"cannot build {NAME}: {missing}")
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    load(name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=list(CFLAGS),
         extra_ldflags=list(LDFLAGS), extra_include_paths=[str(CSRC)],
         build_directory=str(out), is_python_module=False, verbose=verbose)
    unavailable_reason.cache_clear()
    if out.parent == DEFAULT_ROOT:  # this checkout's own folder: earlier sources' builds go
        for old in DEFAULT_ROOT.glob(f"{NAME}-*"):
            if old != out:
                shutil.rmtree(old, ignore_errors=True)
    return library_path()


@functools.cache
def unavailable_reason() -> str | None:
    """Why the kernels cannot serve this process (logged once), or None once loaded."""
    reason = _try_load()
    if reason:
        logger.warning("shoal's C++ CPU kernels are not used (torch paths serve instead): %s",
                       reason)
    return reason


def _try_load() -> str | None:
    path = library_path()
    if not path.exists():
        return (f"not built for this source and torch ({path} is missing); run "
                f"`python -m {__name__} --build`")
    try:
        torch.ops.load_library(str(path))  # idempotent for the same path
    except (OSError, RuntimeError) as e:
        return f"loading {path} failed: {e}"
    return None


def available() -> bool:
    return unavailable_reason() is None


@functools.cache
def layer_ops_enabled() -> bool:
    """Whether the layer ops of layer_ops_cpu.cpp serve (norms, SiLU-and-mul, rotary, the KV
    cache write): built and loaded, and not switched off with SHOAL_CPU_LAYER_KERNELS=0."""
    if not envs.SHOAL_CPU_LAYER_KERNELS.get():
        logger.info("C++ CPU layer ops off (%s=0): the torch paths serve",
                    envs.SHOAL_CPU_LAYER_KERNELS.name)
        return False
    return available()


# What the layer ops (and the KV cache write beside them) take
LAYER_OP_DTYPES = (torch.float32, torch.bfloat16)


def layer_ops_usable(x: torch.Tensor) -> bool:
    """Whether a layer op may run on x: a CPU tensor of a supported dtype, kernels loaded."""
    return x.device.type == "cpu" and x.dtype in LAYER_OP_DTYPES and layer_ops_enabled()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="store_true", help="compile the kernels (if needed)")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if args.build:
        try:
            print(f"{NAME}: {build(verbose=args.verbose)}")
        except Exception as e:  # the compiler's output is in e; the caller decides if fatal
            print(f"{NAME}: build failed: {e}", file=sys.stderr)
            return 1
        return 0
    reason = _try_load()
    print(f"{NAME}: {'loads from ' + str(library_path()) if reason is None else reason}")
    return 0 if reason is None else 1


if __name__ == "__main__":
    sys.exit(main())
