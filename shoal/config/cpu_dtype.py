"""What dtype="auto" means on the CPU: bfloat16 where the CPU multiplies bfloat16 natively,
float32 elsewhere.

A CPU with AVX-512 BF16 (the vdpbf16ps dot product) or AMX (bf16 tiles) runs torch's bfloat16
matmuls through oneDNN at twice float32's rate or more, and the 4-bit GGUF kernel wants
bfloat16 activations: W6 on a 2-core Intel host with AMX made 383-391 output tok/s in bfloat16
against 177 in float32. Without them (AVX2, e.g. AMD Zen 3) torch's bfloat16 matmul is an
emulation at about 1 GFLOP/s, 100x slower than float32. The choice reads the CPU's flags
(/proc/cpuinfo on Linux); where they cannot be read it keeps float32. It is logged once per
process, with the reason. SHOAL_CPU_AUTO_DTYPE pins it (the test suite pins float32, so its
results do not depend on which CI host runs it)."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

from shoal import envs

logger = logging.getLogger(__name__)

# x86 flags (as /proc/cpuinfo names them) of a native bfloat16 matmul.
BF16_MATMUL_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class AutoDtype:
    name: str  # "float32" or "bfloat16"
    reason: str


def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags from /proc/cpuinfo, or None where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return None


def choose_cpu_dtype(flags: frozenset[str] | None, pinned: str | None = None) -> AutoDtype:
    """The decision, from the flags (None: unknown) and SHOAL_CPU_AUTO_DTYPE's value."""
    if pinned is not None:
        return AutoDtype(pinned, f"{envs.SHOAL_CPU_AUTO_DTYPE.name}={pinned}")
    if flags is None:
        return AutoDtype("float32", "the CPU's flags could not be read (no /proc/cpuinfo)")
    native = [f for f in BF16_MATMUL_FLAGS if f in flags]
    if native:
        return AutoDtype("bfloat16", f"the CPU multiplies bfloat16 natively ({', '.join(native)})")
    return AutoDtype("float32", "the CPU has no native bfloat16 matmul (neither "
                                f"{' nor '.join(BF16_MATMUL_FLAGS)}); bfloat16 would be emulated")


@functools.cache
def auto_cpu_dtype() -> str:
    """The dtype name dtype="auto" resolves to on the CPU, logged once per process."""
    choice = choose_cpu_dtype(cpu_flags(), envs.SHOAL_CPU_AUTO_DTYPE.get())
    logger.info("dtype auto on the CPU: %s, because %s", choice.name, choice.reason)
    return choice.name
