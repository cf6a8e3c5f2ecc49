"""The CPU paged decode attention kernel (../csrc/paged_decode_cpu.cpp): build, load, call.

Built ahead of time by `python -m shoal.attention.ops.cpu_paged_decode --build` (the
Makefile's set-up runs it), never inside a request: a compile takes about a minute on a
laptop-class CPU. At run time the kernel is used when the build of this very source, torch
and flags exists (the build folder is named by their hash, so a stale build is never
loaded); otherwise callers keep the torch path and one log line says why.

Set SHOAL_CPU_DECODE_KERNEL=0 to force the torch path (A/B runs); SHOAL_EXTENSIONS_DIR moves
the build folder (default: csrc/build beside the source, git-ignored)."""

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

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "paged_decode_cpu.cpp"
NAME = "shoal_cpu_paged_decode"
# No -march: one build must run on any x86-64; the kernel picks AVX-512/AVX2 at run time.
CFLAGS = ("-O3", "-fopenmp")
LDFLAGS = ("-fopenmp",)
MAX_GROUP, MAX_DIM = 16, 256  # the kernel's per-task buffers (kMaxGroup, kMaxDim)
DTYPES = (torch.float32, torch.bfloat16)
SWITCH_ENV = "SHOAL_CPU_DECODE_KERNEL"


DEFAULT_ROOT = SOURCE.parent / "build"


def build_dir() -> Path:
    root = os.environ.get("SHOAL_EXTENSIONS_DIR")
    return (Path(root) if root else DEFAULT_ROOT) / f"{NAME}-{_fingerprint()}"


def library_path() -> Path:
    return build_dir() / f"{NAME}.so"


@functools.cache
def _fingerprint() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
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
    """Compiles the kernel (ninja skips an up-to-date build) and loads it; returns the library.
    Raises if the toolchain is missing or the compile fails."""
    from torch.utils.cpp_extension import load

    missing = missing_toolchain()
    if missing:
        raise RuntimeError(f"cannot build {NAME}: {missing}")
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    load(name=NAME, sources=[str(SOURCE)], extra_cflags=list(CFLAGS),
         extra_ldflags=list(LDFLAGS), build_directory=str(out), is_python_module=False,
         verbose=verbose)
    unavailable_reason.cache_clear()
    if out.parent == DEFAULT_ROOT:  # this checkout's own folder: earlier sources' builds go
        for old in DEFAULT_ROOT.glob(f"{NAME}-*"):
            if old != out:
                shutil.rmtree(old, ignore_errors=True)
    return library_path()


@functools.cache
def unavailable_reason() -> str | None:
    """Why the kernel cannot serve this process (logged once), or None once it is loaded."""
    reason = _try_load()
    if reason:  # a warning unless asked for
        level = logging.INFO if reason.startswith(SWITCH_ENV) else logging.WARNING
        logger.log(level, "CPU paged decode kernel not used (the torch path serves decodes): "
                   "%s", reason)
    return reason


def _try_load() -> str | None:
    if os.environ.get(SWITCH_ENV) == "0":
        return f"{SWITCH_ENV}=0"
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


def fits(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether q [B, Hq, D] and kv_cache [2, slots, Hk, D] are inside the kernel's contract."""
    hq, d = q.shape[-2], q.shape[-1]
    hk = kv_cache.shape[2]
    return (q.device.type == "cpu" and q.dtype in DTYPES and kv_cache.dtype == q.dtype
            and kv_cache.shape[3] == d and hq % hk == 0 and hq // hk <= MAX_GROUP
            and d <= MAX_DIM and q.stride(-1) == 1 and kv_cache.is_contiguous())


def cpu_paged_decode(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                     scale: float, sliding_window: int | None = None) -> None:
    """Writes into out [B, Hq, D] the attention of q [B, Hq, D] (the token at position
    seq_lens[b] - 1 of each sequence, already in the cache) over keys [0, seq_lens[b]) of
    kv_cache [2, slots, Hk, D], read through block_tables [>= B, N] int64. With a sliding
    window only the last `sliding_window` keys count. seq_lens: int64 [>= B]; 0 gives zeros.
    Call only when available() and fits(q, kv_cache)."""
    torch.ops.shoal_cpu.paged_decode(out, q, kv_cache[0], kv_cache[1], block_tables, seq_lens,
                                     block_size, scale, sliding_window or 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", action="store_true", help="compile the kernel (if needed)")
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
