"""Blocks of the lower tiers on their way into the CPU tier, read in the background.

A lower-tier hit gets a reserved CPU slot and a read (`LowerTier.read_async`: the disk tier's
reader pool, say). The read holds one pin on the slot (never evicted, never cascaded back
down, never served) until `collect` sees it end. A block is read once however many requests
want it: later ones join as waiters. When the read lands, every waiter gets a pin of its
own, so the block cannot be evicted before its request comes back for it; when it fails, the
slot is given back and the tier drops the block. A waiter that gives up (`forget`) leaves the
read running: its block then lands as an ordinary unpinned cached block.

Only `collect` touches tier state, and it runs on the scheduler's thread."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shoal.kv_cache.hashing import BlockHash
from shoal.kv_offload.tier import LowerTier, ReadOutcome, ReadResult

if TYPE_CHECKING:
    from shoal.kv_offload.cpu_tier import CPUTier


@dataclass(eq=False)
class Staging:
    """One request's leading tier hits on their way into the CPU tier. Ready when none is
    being read any more; a ready staging pins each of its hits exactly once."""

    hits: list[BlockHash] = field(default_factory=list)  # in the request's order
    pinned: list[BlockHash] = field(default_factory=list)  # the CPU pins it holds
    waiting: set[BlockHash] = field(default_factory=set)  # its blocks still being read

    @property
    def ready(self) -> bool:
        return not self.waiting


@dataclass(eq=False)
class _Read:
    tier: LowerTier
    future: Future[ReadResult]
    waiters: list[Staging] = field(default_factory=list)


class LowerTierLoads:
    def __init__(self, cpu: CPUTier, tiers: Sequence[LowerTier]):
        self.cpu = cpu
        self.tiers = list(tiers)
        self._reads: dict[BlockHash, _Read] = {}

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._reads

    def __len__(self) -> int:
        return len(self._reads)

    def source(self, block_hash: BlockHash) -> LowerTier:
        """The tier a block in flight is read from."""
        return self._reads[block_hash].tier

    def start(self, tier: LowerTier, block_hash: BlockHash, slot: int, waiter: Staging) -> None:
        """Reads the block from `tier` into `slot`, just reserved for it in the CPU tier."""
        self.cpu.pin(block_hash)  # the read's own pin
        future = tier.read_async(block_hash, self.cpu.payload(slot))
        self._reads[block_hash] = _Read(tier, future)
        self.join(block_hash, waiter)

    def join(self, block_hash: BlockHash, waiter: Staging) -> None:
        self._reads[block_hash].waiters.append(waiter)
        waiter.waiting.add(block_hash)

    def forget(self, waiter: Staging) -> None:
        """The waiter gives up on its reads (they go on without it)."""
        for h in waiter.waiting:
            read = self._reads.get(h)
            if read is not None:
                read.waiters.remove(waiter)
        waiter.waiting.clear()

    def wait_any(self, timeout_s: float) -> None:
        """Blocks until some read ends or the timeout passes (settles nothing)."""
        if self._reads:
            wait([r.future for r in self._reads.values()], timeout_s, FIRST_COMPLETED)

    def collect(self, wait_all: bool = False) -> None:
        """Settles the reads that ended, or every read (waiting for the rest) with wait_all."""
        for h, read in list(self._reads.items()):
            if wait_all or read.future.done():
                del self._reads[h]
                self._settle(h, read)
        for tier in self.tiers:
            tier.stats.load_seconds += tier.take_read_seconds()

    def _settle(self, block_hash: BlockHash, read: _Read) -> None:
        try:
            result = read.future.result()
        except Exception as e:  # read_into returns its errors; this is only a safety net
            result = (ReadOutcome.FAILED, f"{type(e).__name__}: {e}")
        tier = read.tier
        ok = tier.settle(block_hash, result)
        for waiter in read.waiters:
            waiter.waiting.discard(block_hash)
            if ok:
                self.cpu.pin(block_hash)
                waiter.pinned.append(block_hash)
        self.cpu.unpin(block_hash)
        if ok:
            tier.stats.blocks_loaded += 1
            tier.stats.bytes_loaded += tier.layout.payload_bytes(block_hash)
        else:
            self.cpu.remove(block_hash)  # the slot holds garbage: give it back
