"""Backing the CPU KV cache with memory before the first request writes it.

The CPU pool is calloc'd (kv_cache_sizing.zeroed_host_tensor) so that start-up does not write
gigabytes of zeros; its pages are then faulted in one by one as steps first write them. On
this project's 2-core VM a fault costs about 13 us when the writes are scattered, as a step's
KV writes are: the first 14k-token prefill of SmolLM2 spent 1.4 s of its 10 s writing KV
into fresh pages (47 ms a layer against 1 ms once they exist).

So the pool is marked MADV_HUGEPAGE where transparent huge pages are available (a first
write then faults in 2 MiB at a time: 26 ms instead of 260 ms for a 14k-token layer's
scattered KV), and its start, where the block pool hands out blocks first, is populated
now (MADV_POPULATE_WRITE, Linux 5.14+) within a time budget: the kernel maps and zeroes
the pages itself, 0.05-1.3 s a GiB depending on how much it must compact to find huge pages
(22 s for 4 GiB when it finds none), so the rest stays lazy rather than delay start-up. The
pool is one allocation of every layer's planes ([layers, planes, slots, ...]), so each round
backs the next stretch of slots in every plane alike.
The contents stay zeros either way: this only changes when the memory is backed."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import time
from pathlib import Path

import torch

from shoal import envs

logger = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
MADV_POPULATE_WRITE = 23
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
PAGE = 4096
POPULATE_BUDGET_S = 0.5  # start-up time populating may take
POPULATE_ROUND = 64 << 20  # bytes backed per round, over all planes
HUGE_PAGE = 2 << 20


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def huge_pages_available() -> bool:
    """Transparent huge pages on for madvised memory ("always" or "madvise")."""
    try:
        mode = THP_ENABLED.read_text()
    except OSError:
        return False
    return "[never]" not in mode


def populate(t: torch.Tensor, planes: int = 1, budget_s: float = POPULATE_BUDGET_S) -> int:
    """Marks `t` (a host tensor owning its memory, `planes` equal consecutive parts) for huge
    pages and backs the start of every part with zeroed pages now, a stretch per round until
    `budget_s` is spent. Returns the bytes populated (0, nothing done, where the kernel, libc
    or the huge-page setting does not allow it)."""
    madvise = _madvise()
    if (not envs.SHOAL_KV_HUGE_PAGES.get() or madvise is None or t.device.type != "cpu"
            or not huge_pages_available()):
        return 0
    ptr, total = t.data_ptr(), t.numel() * t.element_size()
    start = ptr - ptr % PAGE
    if madvise(start, total + (ptr - start), MADV_HUGEPAGE) != 0:
        return 0
    part = total // planes
    step = max(POPULATE_ROUND // planes, HUGE_PAGE)
    t0 = time.perf_counter()
    done = offset = 0
    while offset < part:
        n = min(step, part - offset)
        for p in range(planes):
            if time.perf_counter() - t0 > budget_s:
                offset = part
                break
            lo = ptr + p * part + offset
            aligned = lo - lo % PAGE
            if madvise(aligned, n + (lo - aligned), MADV_POPULATE_WRITE) != 0:
                logger.debug("MADV_POPULATE_WRITE failed (errno %d)", ctypes.get_errno())
                return done  # EINVAL before Linux 5.14
            done += n
        offset += n
    logger.info("CPU KV cache on huge pages: %.0f of %.0f MiB backed in %.2f s", done / 2**20,
                total / 2**20, time.perf_counter() - t0)
    return done
