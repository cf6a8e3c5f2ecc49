"""The disk tier's reads, on a small thread pool so the scheduler never waits for the disk.

Each read is one file straight into a pinned CPU-tier slot, checksum included (disk_format
.read_block), so several run at once: one file per block at about 1 GB/s on one thread is far
from what an NVMe drive gives to parallel reads. The pool only does I/O: the tiers' indexes,
policies and statistics are updated by whoever collects the results, on the scheduler's
thread.

The time it reports is wall time with at least one read running, not the sum over threads,
so bytes loaded / load seconds is the bandwidth the disk tier delivered."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

DEFAULT_READ_THREADS = 8


class DiskReader:
    def __init__(self, num_threads: int = DEFAULT_READ_THREADS,
                 clock: Callable[[], float] = time.perf_counter):
        self.num_threads = max(1, num_threads)
        self._clock = clock  # injectable, so tests can check the busy time exactly
        self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="shoal-kv-read")
        self._lock = threading.Lock()
        self._active = 0
        self._busy_since = 0.0
        self._busy_seconds = 0.0  # ended busy periods not taken yet

    def submit(self, fn: Callable[..., T], *args: object) -> Future[T]:
        return self._pool.submit(self._timed, fn, *args)

    def take_busy_seconds(self) -> float:
        """Reading time since the last call (periods still running count once they end)."""
        with self._lock:
            s, self._busy_seconds = self._busy_seconds, 0.0
        return s

    def close(self) -> None:
        """Lets queued reads finish and joins the threads."""
        self._pool.shutdown(wait=True)

    def _timed(self, fn: Callable[..., T], *args: object) -> T:
        with self._lock:
            if not self._active:
                self._busy_since = self._clock()
            self._active += 1
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._active -= 1
                if not self._active:
                    self._busy_seconds += self._clock() - self._busy_since
