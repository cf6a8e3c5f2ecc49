"""The disk tier's file writes and deletions, run in order on one background thread so the
engine loop pays only a memory copy per stored block.

Order is what keeps the disk tier correct: a victim's file is deleted before the file that
replaced it is written (the size limit holds on disk at every moment), and a block deleted
then stored again is deleted, then written. Until its file is written, a block is served
from the copy kept here."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from shoal.kv_offload.disk_format import write_block
from shoal.kv_offload.stats import TierStats

logger = logging.getLogger(__name__)


class DiskWriter:
    def __init__(self, stats: TierStats, background: bool = True, max_pending: int = 256):
        self.stats = stats  # this writer alone updates stats.store_seconds
        self.max_pending = max_pending  # queued jobs before the engine waits (bounds memory)
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix="shoal-kv-disk")
                      if background else None)
        self._jobs: deque[Future] = deque()
        self._lock = threading.Lock()
        self._pending: dict[Path, torch.Tensor] = {}
        self.failed_writes = 0
        self._failed: list[Path] = []  # files that could not be written, for take_failed()

    def write(self, path: Path, key_digest: bytes, block_hash: bytes, payload: torch.Tensor) -> None:
        copy = payload.clone() if self._pool is not None else payload
        with self._lock:
            self._pending[path] = copy
        self._submit(self._write, path, key_digest, block_hash, copy)

    def unlink(self, path: Path) -> None:
        with self._lock:
            self._pending.pop(path, None)
        self._submit(unlink_quietly, path)

    def take_failed(self) -> list[Path]:
        """Files whose write failed since the last call (their blocks are not on disk)."""
        if not self._failed:
            return []
        with self._lock:
            failed, self._failed = self._failed, []
        return failed

    def pending(self, path: Path) -> torch.Tensor | None:
        """The payload of a block whose file is not written yet."""
        with self._lock:
            return self._pending.get(path)

    def drain(self) -> None:
        """Waits until every queued job has run."""
        while self._jobs:
            self._jobs.popleft().result()

    def close(self) -> None:
        self.drain()
        if self._pool is not None:
            self._pool.shutdown()

    def _submit(self, fn: Callable[..., None], *args: object) -> None:
        if self._pool is None:
            fn(*args)
            return
        while self._jobs and self._jobs[0].done():
            self._jobs.popleft().result()
        while len(self._jobs) >= self.max_pending:  # back-pressure: the disk is behind
            self._jobs.popleft().result()
        try:
            self._jobs.append(self._pool.submit(fn, *args))
        except RuntimeError:  # the interpreter is exiting (an atexit shutdown): its thread
            self.drain()  # pools take no new work, so finish in order on this thread
            fn(*args)

    def _write(self, path: Path, key_digest: bytes, block_hash: bytes,
               payload: torch.Tensor) -> None:
        t0 = time.perf_counter()
        failed = False
        try:
            write_block(path, key_digest, block_hash, payload)
        except OSError as e:  # disk full, read-only...: nothing is left under any name
            failed = True
            self.failed_writes += 1
            if self.failed_writes == 1 or self.failed_writes % 1000 == 0:
                logger.warning("cannot write disk KV block %s (%d failed writes so far): %s",
                               block_hash.hex(), self.failed_writes, e)
        finally:
            with self._lock:  # no longer pending when take_failed() sees it
                if self._pending.get(path) is payload:
                    del self._pending[path]
                if failed:
                    self._failed.append(path)
            self.stats.store_seconds += time.perf_counter() - t0


def unlink_quietly(path: str | Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
