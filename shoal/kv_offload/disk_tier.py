"""The disk tier: one file per block in a directory named after the store key, so another
model, dtype, block size or layout never sees these files.

The index is rebuilt at start-up by listing the directory (files of the wrong size and
leftover temporary files are deleted; headers and checksums are checked at load), so blocks
survive a restart. The size limit counts whole files and holds at all times: room is made by
the policy before a file is written. A partitioned pool's blocks (DeepSeek-V4) make files of
a size per KV cache group (BlockLayout.payload_bytes): the limit then counts their bytes.

Reads come in the two halves of a `LowerTier`: `read_into` (file or pending write -> memory,
verified; touches no state, any thread) and `settle` (index, policy and statistics, on the
owning thread). `load` does both in a row; `read_async` runs the first half on the tier's
DiskReader pool."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from shoal.kv_cache.hashing import BlockHash
from shoal.kv_offload.disk_format import (
    HEADER_BYTES,
    SUFFIX,
    TMP_MARK,
    DamagedBlockError,
    file_name,
    read_block,
)
from shoal.kv_offload.disk_reader import DEFAULT_READ_THREADS, DiskReader
from shoal.kv_offload.disk_writer import DiskWriter, unlink_quietly
from shoal.kv_offload.layout import BlockLayout, StoreKey
from shoal.kv_offload.policy import EvictionPolicy, make_policy
from shoal.kv_offload.tier import LowerTier, ReadOutcome, ReadResult, TierContext

logger = logging.getLogger(__name__)


def build_disk_tier(ctx: TierContext) -> DiskTier | None:
    """The disk tier of kv_offloading_disk_path / kv_offloading_disk_size, or None without a
    path (lower_tiers.py lists this builder)."""
    oc = ctx.config
    if oc.disk_path is None:
        return None
    blocks = oc.disk_bytes // smallest_file(ctx.layout)
    return DiskTier(os.fspath(oc.disk_path), ctx.key, ctx.layout, oc.disk_bytes,
                    make_policy(oc.policy, blocks))


def smallest_file(layout: BlockLayout) -> int:
    """The smallest file a block makes (a partitioned pool's blocks differ by KV cache
    group): what the most files that fit are counted with."""
    return HEADER_BYTES + min(layout.group_bytes or (layout.nbytes,))


class DiskTier(LowerTier):
    name = "disk"

    def __init__(self, root: str | Path, key: StoreKey, layout: BlockLayout, capacity_bytes: int,
                 policy: EvictionPolicy, background_writes: bool = True,
                 read_threads: int = DEFAULT_READ_THREADS):
        file_bytes = HEADER_BYTES + layout.nbytes
        super().__init__(layout, capacity_bytes // smallest_file(layout), file_bytes, policy)
        # The size limit: whole files of one size, or the bytes themselves where a
        # partitioned pool's files differ in size by group
        self._limit = (capacity_bytes if layout.group_bytes
                       else self.capacity_blocks * file_bytes)
        self.stats.capacity_bytes = self._limit
        self._bytes = 0  # of the files indexed
        self.key = key
        self.key_digest = key.digest()
        self.dir = Path(root).expanduser() / key.dirname()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._write_meta()
        self._index: set[BlockHash] = set()
        self.writer = DiskWriter(self.stats, background=background_writes)
        self.reader = DiskReader(read_threads)  # threads start with the first read
        self._scan()
        if not self.capacity_blocks:
            logger.warning("kv_offloading_disk_size is smaller than one block (%d bytes): the "
                           "disk tier stores nothing", file_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self._limit

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def _add(self, block_hash: BlockHash) -> None:
        self._index.add(block_hash)
        self._bytes += self._file_bytes(block_hash)

    def _drop(self, block_hash: BlockHash) -> None:
        if block_hash in self._index:
            self._index.discard(block_hash)
            self._bytes -= self._file_bytes(block_hash)

    def _file_bytes(self, block_hash: BlockHash) -> int:
        """A block's file size: a partitioned pool's blocks differ by KV cache group (the
        size limit still counts every file as the largest: entry_bytes)."""
        try:
            return HEADER_BYTES + self.layout.payload_bytes(block_hash)
        except ValueError:  # a key naming no group of this layout: not one of ours
            return -1

    def _path(self, block_hash: BlockHash) -> Path:
        return self.dir / file_name(block_hash)

    def _write_meta(self) -> None:
        """A human-readable note of what the directory holds (never read back: the digest in
        the directory name and in every header is what is checked)."""
        meta = self.dir / "key.json"
        if not meta.exists():
            tmp = self.dir / f"key.json{TMP_MARK}{os.getpid()}"
            try:
                tmp.write_text(self.key.to_json() + "\n")
                os.replace(tmp, meta)
            except OSError as e:  # a full disk: the note is optional, the tier still works
                unlink_quietly(tmp)
                logger.warning("cannot write %s: %s", meta, e)

    def _scan(self) -> None:
        found: list[tuple[float, BlockHash]] = []
        for entry in os.scandir(self.dir):
            name = entry.name
            if TMP_MARK in name:  # a write cut short by a crash
                unlink_quietly(entry.path)
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                block_hash = bytes.fromhex(name[: -len(SUFFIX)])
                st = entry.stat()
            except (ValueError, OSError):
                continue
            if st.st_size != self._file_bytes(block_hash):
                unlink_quietly(entry.path)
                self.stats.damaged += 1
                continue
            found.append((st.st_mtime, block_hash))
        # Oldest first, so LRU-like policies evict what was written longest ago first.
        for _, h in sorted(found):
            self.policy.prepare(h)
            self.policy.insert(h)
            self._add(h)
        while self._bytes > self._limit and self.evict(1):  # the size limit was lowered
            pass
        self._sync_usage()
        if self._index:
            logger.info("disk KV tier %s: %d blocks found", self.dir, len(self._index))

    # -- queries ------------------------------------------------------------------------------
    def _forget_failed_writes(self) -> None:
        """Blocks whose file could not be written (a full disk) leave the index."""
        for path in self.writer.take_failed():
            h = bytes.fromhex(path.name[: -len(SUFFIX)])
            # (a later write of the same block may have succeeded since, or be queued)
            if h in self._index and self.writer.pending(path) is None and not path.exists():
                self._forget(h)

    def contains(self, block_hash: BlockHash) -> bool:
        if self.writer.failed_writes:
            self._forget_failed_writes()
        return block_hash in self._index

    def __len__(self) -> int:
        self._forget_failed_writes()
        return len(self._index)

    def keys(self) -> list[BlockHash]:
        self._forget_failed_writes()
        return list(self._index)

    # -- data ---------------------------------------------------------------------------------
    def read_into(self, block_hash: BlockHash, dst: torch.Tensor) -> ReadResult:
        """Copies one block into dst ([*block_shape]) and verifies it. Any thread: it touches no
        state of the tier, `settle` applies the outcome. dst holds garbage unless OK."""
        path = self._path(block_hash)
        try:
            pending = self.writer.pending(path)
            if pending is not None:  # its file is still being written
                dst.copy_(pending)
            else:
                read_block(path, self.key_digest, block_hash, dst)
        except FileNotFoundError:
            return ReadOutcome.MISSING, "no file"
        except (DamagedBlockError, OSError) as e:
            return ReadOutcome.DAMAGED, str(e)
        except Exception as e:  # never let one bad read take the engine down
            return ReadOutcome.FAILED, f"{type(e).__name__}: {e}"
        return ReadOutcome.OK, ""

    def read_async(self, block_hash: BlockHash, dst: torch.Tensor) -> Future[ReadResult]:
        """`read_into` on the reader pool; settle the result on the owning thread."""
        return self.reader.submit(self.read_into, block_hash, dst)

    def take_read_seconds(self) -> float:
        return self.reader.take_busy_seconds()

    def settle(self, block_hash: BlockHash, result: ReadResult) -> bool:
        if result[0] is ReadOutcome.MISSING:  # no file to delete
            self._forget(block_hash)
            return False
        return super().settle(block_hash, result)

    def load(self, hashes: Sequence[BlockHash], dst: torch.Tensor) -> int:
        t0 = time.perf_counter()
        n = 0
        for i, h in enumerate(hashes):
            if h not in self._index or not self.settle(h, self.read_into(h, dst[i])):
                break
            n += 1
        self.stats.record_load(n, sum(map(self.layout.payload_bytes, hashes[:n])),
                               time.perf_counter() - t0)
        return n

    def store(self, hashes: Sequence[BlockHash], src: torch.Tensor) -> int:
        """Queues the writes (see disk_writer.py); time is counted when the writer runs."""
        n = written = nbytes = 0
        for i, h in enumerate(hashes):
            if h in self._index:
                self.policy.touch(h)
                n += 1
                continue
            if not self.capacity_blocks:
                break
            self.policy.prepare(h)
            size = self._file_bytes(h)
            while self._bytes + size > self._limit:
                if not self.evict(1):
                    break
            if self._bytes + size > self._limit:
                break
            self.writer.write(self._path(h), self.key_digest, h, src[i])
            self._add(h)
            self.policy.insert(h)
            written += 1
            nbytes += self.layout.payload_bytes(h)
            n += 1
        self._sync_usage()
        self.stats.blocks_stored += written
        self.stats.bytes_stored += nbytes
        return n

    def remove(self, block_hash: BlockHash) -> bool:
        if block_hash not in self._index:
            return False
        self.writer.unlink(self._path(block_hash))
        self._forget(block_hash)
        return True

    def _forget(self, block_hash: BlockHash) -> None:
        self._drop(block_hash)
        self.policy.remove(block_hash)
        self._sync_usage()

    def evict(self, num_blocks: int) -> int:
        n = 0
        while n < num_blocks and self._index:
            victim = self.policy.evict(lambda _: True)
            if victim is None:
                break
            self._drop(victim)
            self.writer.unlink(self._path(victim))
            self.stats.evictions += 1
            n += 1
        self._sync_usage()
        return n

    def drain(self) -> None:
        self.writer.drain()

    def close(self) -> None:
        """Joins the reader threads (reads in flight finish), then drains and stops the writer."""
        self.reader.close()
        self.writer.close()

    def check(self) -> None:
        """Invariants, for tests: the index is exactly the files, within the size limit."""
        self.writer.drain()
        self._forget_failed_writes()
        on_disk = {bytes.fromhex(p.name[: -len(SUFFIX)]) for p in self.dir.glob("*" + SUFFIX)}
        assert on_disk == self._index, "index and directory disagree"
        assert len(self.policy) == len(self._index), "policy and tier disagree"
        size = sum(p.stat().st_size for p in self.dir.glob("*" + SUFFIX))
        assert size <= self.capacity_bytes, f"{size} bytes on disk > limit {self.capacity_bytes}"
        assert size == self._bytes, f"{size} bytes on disk, {self._bytes} counted"

