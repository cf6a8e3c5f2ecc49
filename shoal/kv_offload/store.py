"""TieredKVStore: the secondary tiers chained behind one interface, fastest first.

The CPU tier is the gateway: the device exchanges blocks with it only. Blocks evicted from the
device go to the CPU tier; blocks evicted from the CPU tier cascade to disk (write-back: a
block reaches disk when the CPU tier lets go of it, or on flush()). A hit on disk is staged
through the CPU tier (read and verified there), so a damaged file turns into a miss before
anything is scheduled, and the model runner only ever copies between the device and host
memory."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import torch

from shoal.kv_cache.hashing import BlockHash
from shoal.kv_offload.cpu_tier import CPUTier
from shoal.kv_offload.disk_tier import DiskTier
from shoal.kv_offload.stats import KVOffloadStats
from shoal.kv_offload.tier import KVTier

logger = logging.getLogger(__name__)


class TieredKVStore:
    def __init__(self, cpu: CPUTier, disk: DiskTier | None = None):
        self.cpu = cpu
        self.disk = disk
        cpu.on_evict = self._demote
        # Waits for the model runner's in-flight copies (set by the runner on CUDA), so host
        # memory is not read or reused under an asynchronous copy.
        self.fence: Callable[[], None] = lambda: None

    @property
    def tiers(self) -> list[KVTier]:
        return [self.cpu] + ([self.disk] if self.disk is not None else [])

    def tier(self, name: str) -> KVTier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no KV tier named {name!r}")

    # -- lookups ------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[BlockHash], skip: Iterable[str] = ()) -> int:
        """Leading blocks held by some tier not in `skip` (a CPU prefix continuing on disk
        counts). Read-only apart from the statistics."""
        tiers = self._usable(skip)
        n = 0
        for h in hashes:
            if not any(t.lookup([h]) for t in tiers):
                break
            n += 1
        return n

    def _usable(self, skip: Iterable[str]) -> list[KVTier]:
        skip = set(skip)
        if "cpu" in skip:  # disk blocks travel through the CPU tier: skipping it skips all
            return []
        return [t for t in self.tiers if t.name not in skip]

    def stage(self, hashes: Sequence[BlockHash], skip: Iterable[str] = ()) -> list[int]:
        """Brings the leading hits into the CPU tier and pins them; returns their CPU slots.
        The caller unpins each hash once the device copy is done (or abandoned). Stops at
        the first miss, at a damaged disk block, or when the CPU tier has no unpinned room."""
        tiers = self._usable(skip)
        slots: list[int] = []
        for h in hashes:
            slot = None
            for t in tiers:
                if not t.lookup([h]):
                    continue
                slot = self._stage_one(t, h)
                break
            if slot is None:
                break
            self.cpu.pin(h)
            slots.append(slot)
        return slots

    def _stage_one(self, tier: KVTier, h: BlockHash) -> int | None:
        if tier is self.cpu:
            self.cpu.touch(h)
            return self.cpu.slot_of(h)
        self.fence()
        slot = self.cpu.reserve(h)
        if slot is None:
            return None
        if tier.load([h], self.cpu.pool[slot:slot + 1]) != 1:
            self.cpu.remove(h)  # damaged or gone: the slot holds garbage, give it back
            return None
        return slot

    # -- stores -------------------------------------------------------------------------------
    def reserve_for_device(self, h: BlockHash) -> int | None:
        """A pinned CPU slot for a device block about to be reused, or None when the CPU tier
        already holds the block (only its recency is updated) or has no unpinned room."""
        if self.cpu.contains(h):
            self.cpu.touch(h)
            return None
        self.fence()
        slot = self.cpu.reserve(h)
        if slot is not None:
            self.cpu.pin(h)
        return slot

    def _demote(self, h: BlockHash, payload: torch.Tensor) -> None:
        """CPU eviction hook: the block continues on disk, unless it is there already."""
        if self.disk is None:
            return
        if self.disk.contains(h):
            self.disk.policy.touch(h)
            return
        self.disk.store([h], payload.unsqueeze(0))

    def unpin(self, hashes: Iterable[BlockHash]) -> None:
        for h in hashes:
            self.cpu.unpin(h)

    # -- maintenance --------------------------------------------------------------------------
    def flush(self) -> int:
        """Moves every unpinned CPU block down to disk (e.g. before a restart) and empties the
        CPU tier of them; returns how many were evicted."""
        self.fence()
        n = self.cpu.evict(len(self.cpu))
        self.drain()
        return n

    def drain(self) -> None:
        """Waits for queued disk writes and deletions."""
        if self.disk is not None:
            self.disk.writer.drain()

    def close(self) -> None:
        """Finishes queued disk work and stops the writer thread (blocks in memory are lost:
        call flush() first to keep them)."""
        if self.disk is not None:
            self.disk.writer.close()

    def clear(self, tier: str | None = None) -> None:
        """Drops blocks without cascading: one tier by name, or all of them."""
        self.fence()
        for t in self.tiers if tier is None else [self.tier(tier)]:
            t.clear()
        self.drain()

    def stats(self) -> KVOffloadStats:
        return KVOffloadStats([t.stats for t in self.tiers])

    def check(self) -> None:
        """Invariants of every tier, for tests."""
        for t in self.tiers:
            t.check()
