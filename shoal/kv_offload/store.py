"""TieredKVStore: the secondary tiers chained behind one interface, fastest first.

The first tier is the CPU tier, the gateway: the device exchanges blocks with it only. The
tiers after it are lower tiers (the disk, or whatever lower_tiers.py lists). Blocks evicted
from the device go to the CPU tier; a block the CPU tier evicts is written back to each lower
tier that does not hold it yet (when the CPU tier lets go of it, or on flush()). A hit in a
lower tier is staged through the CPU tier (read and verified there), so a damaged block turns
into a miss before anything is scheduled, and the model runner only ever copies between the
device and host memory.

Staging is asynchronous where a lower tier is involved: `begin_stage` pins the CPU hits at
once and starts background reads for lower-tier hits (loads.py); `collect` settles the reads
that ended, and the caller walks again (`begin_stage(..., count=False)`) once its staging is
ready. `stage` does all of that in one blocking call.

The store never waits for the device: a CPU slot that a device copy reads or writes is pinned
until the scheduler hears that the copy is done (connector.py), and pinned slots are never
evicted, reused or written down. Imports no torch: the scheduler holds a store.

Call `shutdown()` when the engine stops: CPU-tier blocks go down to the lower tiers so a
restart on the same disk path finds them."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from shoal.kv_cache.hashing import BlockHash
from shoal.kv_offload.loads import LowerTierLoads, Staging
from shoal.kv_offload.stats import KVOffloadStats
from shoal.kv_offload.tier import KVTier, LowerTier

if TYPE_CHECKING:
    import torch

    from shoal.kv_offload.cpu_tier import CPUTier

logger = logging.getLogger(__name__)


class TieredKVStore:
    def __init__(self, tiers: Sequence[KVTier]):
        """tiers: the CPU tier, then the lower tiers, fastest first."""
        if not tiers or isinstance(tiers[0], LowerTier):
            raise ValueError("a KV store starts with its CPU tier")
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"KV tier names must differ (got {names})")
        self.tiers: list[KVTier] = list(tiers)
        self.cpu: CPUTier = tiers[0]  # type: ignore[assignment]
        self.lower: list[LowerTier] = []
        for t in tiers[1:]:
            if not isinstance(t, LowerTier):
                raise TypeError(f"KV tier {t.name!r} below the CPU tier must be a LowerTier")
            self.lower.append(t)
        self.cpu.on_evict = self._demote
        self.loads = LowerTierLoads(self.cpu, self.lower) if self.lower else None
        # Slots reserved for device blocks whose copy has not completed: their bytes are
        # garbage until then, so shutdown() must not write them down.
        self._unfilled: set[BlockHash] = set()
        # Blocks to drop once their pins are gone (discarded while a copy used their slot).
        self._doomed: set[BlockHash] = set()
        self._closed = False

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

    def holds(self, h: BlockHash, skip: Iterable[str] = ()) -> bool:
        """Some tier not in `skip` holds the block, or is reading it (no statistics)."""
        return self._source(h, self._usable(skip)) is not None

    def _usable(self, skip: Iterable[str]) -> list[KVTier]:
        skip = set(skip)
        if self.cpu.name in skip:  # lower-tier blocks travel through the CPU tier
            return []
        return [t for t in self.tiers if t.name not in skip]

    def begin_stage(self, hashes: Sequence[BlockHash], skip: Iterable[str] = (),
                    count: bool = True) -> Staging:
        """The leading blocks held by a tier not in `skip`, without waiting for a lower tier:
        CPU hits are pinned, lower-tier hits get a reserved CPU slot and a background read (or
        join a read already running). Stops at the first miss or when the CPU tier has no
        unpinned room. Not ready while reads run: `collect()`, then walk again with
        count=False (the lookups were counted once) and `release` this one. `count` updates
        queries/hits."""
        tiers = self._usable(skip)
        st = Staging()
        for h in hashes:
            source = self._source(h, tiers)
            self._count(tiers, source, count)
            if source is None or not self._stage_block(h, source, st):
                break
            st.hits.append(h)
        return st

    def _source(self, h: BlockHash, tiers: list[KVTier]) -> KVTier | None:
        """The usable tier a block comes from: the one it is being read from, else the first
        that holds it."""
        if self.loads is not None and h in self.loads:
            source = self.loads.source(h)
            return source if source in tiers else None
        return next((t for t in tiers if t.contains(h)), None)

    def _stage_block(self, h: BlockHash, source: KVTier, st: Staging) -> bool:
        if self.loads is not None and h in self.loads:  # being read for another request
            self.loads.join(h, st)
        elif source is self.cpu:
            self.cpu.touch(h)
            self.cpu.pin(h)
            st.pinned.append(h)
        else:
            slot = self.cpu.reserve(h)
            if slot is None:
                return False
            assert self.loads is not None and isinstance(source, LowerTier)
            self.loads.start(source, h, slot, st)
        return True

    @staticmethod
    def _count(tiers: list[KVTier], hit: KVTier | None, count: bool) -> None:
        """Counts one block's lookup the way KVTier.lookup does: tiers asked in order."""
        if not count:
            return
        for t in tiers:
            t.stats.queries += 1
            if t is hit:
                t.stats.hits += 1
                return

    def collect(self) -> None:
        """Settles the lower-tier reads that ended (never waits): waiters pin what arrived."""
        if self.loads is not None:
            self.loads.collect()

    def wait_loads(self) -> None:
        """Waits for every lower-tier read in flight and settles it."""
        if self.loads is not None:
            self.loads.collect(wait_all=True)

    def wait_for_a_load(self, timeout_s: float) -> None:
        """Blocks until some lower-tier read ends or the timeout passes (settles nothing)."""
        if self.loads is not None:
            self.loads.wait_any(timeout_s)

    def slots(self, staging: Staging) -> list[int]:
        """CPU slots of a ready staging's hits, in order."""
        assert staging.ready
        return [self.cpu.slot_of(h) for h in staging.hits]

    def release(self, staging: Staging) -> None:
        """Drops a staging's pins; its reads still running finish without it."""
        if self.loads is not None:
            self.loads.forget(staging)
        self.unpin(staging.pinned)
        staging.pinned = []

    def stage(self, hashes: Sequence[BlockHash], skip: Iterable[str] = ()) -> list[int]:
        """Blocking form of begin_stage: brings the leading hits into the CPU tier and pins
        them (once each); returns their CPU slots. The caller unpins each hash once the device
        copy is done (or abandoned). A damaged lower-tier block ends the run."""
        return self.slots(self.finish_stage(self.begin_stage(hashes, skip), hashes, skip))

    def finish_stage(self, staging: Staging, hashes: Sequence[BlockHash],
                     skip: Iterable[str] = ()) -> Staging:
        """Waits for a staging's reads and walks again until ready (blocking)."""
        while not staging.ready:
            self.wait_loads()
            # The old staging keeps its pins until the new walk has its own: nothing it read
            # can be evicted in between. A read that failed ends the new walk there.
            again = self.begin_stage(hashes, skip, count=False)
            self.release(staging)
            staging = again
        return staging

    # -- stores -------------------------------------------------------------------------------
    def reserve_for_device(self, h: BlockHash) -> int | None:
        """A pinned CPU slot for a device block about to be reused, or None when the CPU tier
        already holds the block (only its recency is updated) or has no unpinned room. Its
        bytes count only once `filled` says the copy is done."""
        if self.cpu.contains(h):
            self.cpu.touch(h)
            return None
        slot = self.cpu.reserve(h)
        if slot is not None:
            self.cpu.pin(h)
            self._unfilled.add(h)
        return slot

    def filled(self, hashes: Iterable[BlockHash]) -> None:
        """The device -> CPU copies into these slots have completed."""
        self._unfilled.difference_update(hashes)

    def _demote(self, h: BlockHash, payload: torch.Tensor) -> None:
        """CPU eviction hook: the block continues in each lower tier that lacks it."""
        for t in self.lower:
            if t.contains(h):
                t.touch(h)
            else:
                t.store([h], payload.unsqueeze(0))

    def unpin(self, hashes: Iterable[BlockHash]) -> None:
        for h in hashes:
            self.cpu.unpin(h)
            if self._doomed and h in self._doomed and not self.cpu.is_pinned(h):
                self._doomed.discard(h)
                self._drop_cpu(h)

    def discard(self, hashes: Iterable[BlockHash]) -> None:
        """Drops blocks whose content cannot be trusted (a request that produced non-finite
        values, a copy of a step that raised) from every tier. A CPU slot still pinned by a
        copy in flight goes once it is unpinned, and is never written down meanwhile."""
        for h in hashes:
            if self.cpu.contains(h):
                if self.cpu.is_pinned(h):
                    self._doomed.add(h)
                else:
                    self._drop_cpu(h)
            for t in self.lower:
                if t.contains(h):
                    t.remove(h)

    def _drop_cpu(self, h: BlockHash) -> None:
        self.cpu.remove(h)
        self._unfilled.discard(h)

    # -- maintenance --------------------------------------------------------------------------
    def flush(self) -> int:
        """Moves every unpinned CPU block down to the lower tiers (e.g. before a restart) and
        empties the CPU tier of them; returns how many were evicted."""
        n = self.cpu.evict(len(self.cpu))
        self.drain()
        return n

    def drain(self) -> None:
        """Waits for the lower tiers' queued writes and deletions."""
        for t in self.lower:
            t.drain()

    def shutdown(self) -> None:
        """Call once when the engine stops, between steps and with no step in flight: waits
        for the lower-tier reads, writes every CPU-tier block down to the lower tiers (the
        least recently used first, so a full disk keeps the hottest; a slot whose device copy
        never completed is left out), waits for the writes and stops the threads. The store
        is unusable afterwards. Device blocks are not included: control.persist(core) pushes
        those down first."""
        if self._closed:
            return
        self.wait_loads()
        if self.lower:
            self.cpu.evict(len(self.cpu))  # unpinned blocks cascade down in policy order
            for h in self.cpu.keys():  # still pinned (a waiting request holds it): copy it down
                if h not in self._unfilled and h not in self._doomed:
                    self._demote(h, self.cpu.payload(self.cpu.slot_of(h)))
        self.close()

    def close(self) -> None:
        """Lets reads in flight finish, then finishes the lower tiers' queued work and stops
        their threads (blocks in memory are lost: shutdown() keeps them)."""
        self._closed = True
        self.wait_loads()
        for t in self.lower:
            t.close()

    def clear(self, tier: str | None = None) -> None:
        """Drops blocks without cascading: one tier by name, or all of them (blocks pinned in the
        CPU tier stay)."""
        self.wait_loads()  # a read landing later would bring its block back
        for t in self.tiers if tier is None else [self.tier(tier)]:
            t.clear()
        self.drain()

    def stats(self) -> KVOffloadStats:
        return KVOffloadStats([t.stats for t in self.tiers])

    def check(self) -> None:
        """Invariants of every tier, for tests."""
        for t in self.tiers:
            t.check()
