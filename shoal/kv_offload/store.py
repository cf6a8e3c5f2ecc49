"""TieredKVStore: the secondary tiers chained behind one interface, fastest first.

The CPU tier is the gateway: the device exchanges blocks with it only. Blocks evicted from the
device go to the CPU tier; blocks evicted from the CPU tier cascade to disk (write-back: a
block reaches disk when the CPU tier lets go of it, or on flush()). A hit on disk is staged
through the CPU tier (read and verified there), so a damaged file turns into a miss before
anything is scheduled, and the model runner only ever copies between the device and host
memory.

Staging is asynchronous where the disk is involved: `begin_stage` pins the CPU hits at once and
starts background reads for disk hits (loads.py); `collect` settles the reads that ended, and
the caller walks again (`begin_stage(..., count=False)`) once its staging is ready. `stage`
does all of that in one blocking call.

Call `shutdown()` when the engine stops: CPU-tier blocks go down to disk so a restart on the
same path finds them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence

import torch

from shoal.kv_cache.hashing import BlockHash
from shoal.kv_offload.cpu_tier import CPUTier
from shoal.kv_offload.disk_tier import DiskTier
from shoal.kv_offload.loads import DiskLoads, Staging
from shoal.kv_offload.stats import KVOffloadStats
from shoal.kv_offload.tier import KVTier

logger = logging.getLogger(__name__)


class TieredKVStore:
    def __init__(self, cpu: CPUTier, disk: DiskTier | None = None):
        self.cpu = cpu
        self.disk = disk
        cpu.on_evict = self._demote
        self.loads = DiskLoads(cpu, disk) if disk is not None else None
        # Waits for the model runner's in-flight copies (set by the runner on CUDA), so host
        # memory is not read or reused under an asynchronous copy.
        self.fence: Callable[[], None] = lambda: None
        # Slots reserved for device blocks whose copy is not handed to the runner yet: their
        # bytes are garbage until then, so shutdown() must not persist them.
        self._unfilled: set[BlockHash] = set()
        self._closed = False

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

    def begin_stage(self, hashes: Sequence[BlockHash], skip: Iterable[str] = (),
                    count: bool = True) -> Staging:
        """The leading blocks held by a tier not in `skip`, without waiting for the disk: CPU
        hits are pinned, disk hits get a reserved CPU slot and a background read (or join a
        read already running). Stops at the first miss or when the CPU tier has no unpinned
        room. Not ready while reads run: `collect()`, then walk again with count=False (the
        lookups were counted once) and `release` this one. `count` updates queries/hits."""
        tiers = self._usable(skip)
        use_cpu, use_disk = self.cpu in tiers, self.disk is not None and self.disk in tiers
        st = Staging()
        for h in hashes:
            if self.loads is not None and h in self.loads:  # being read for another request
                if not use_disk:
                    self._count(tiers, None, count)
                    break
                self._count(tiers, self.disk, count)
                self.loads.join(h, st)
            elif use_cpu and self.cpu.contains(h):
                self._count(tiers, self.cpu, count)
                self.cpu.touch(h)
                self.cpu.pin(h)
                st.pinned.append(h)
            elif use_disk and self.disk.contains(h):
                self._count(tiers, self.disk, count)
                self.fence()
                slot = self.cpu.reserve(h)
                if slot is None:
                    break
                self.loads.start(h, slot, st)
            else:
                self._count(tiers, None, count)
                break
            st.hits.append(h)
        return st

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
        """Settles the disk reads that ended (never waits): waiters pin what arrived."""
        if self.loads is not None:
            self.loads.collect()

    def wait_loads(self) -> None:
        """Waits for every disk read in flight and settles it."""
        if self.loads is not None:
            self.loads.collect(wait_all=True)

    def wait_for_a_load(self, timeout_s: float) -> None:
        """Blocks until some disk read ends or the timeout passes (settles nothing)."""
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
        copy is done (or abandoned). A damaged disk block ends the run."""
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
        already holds the block (only its recency is updated) or has no unpinned room."""
        if self.cpu.contains(h):
            self.cpu.touch(h)
            return None
        self.fence()
        slot = self.cpu.reserve(h)
        if slot is not None:
            self.cpu.pin(h)
            self._unfilled.add(h)
        return slot

    def filled(self, hashes: Iterable[BlockHash]) -> None:
        """The device -> CPU copies into these slots are handed to the runner (their bytes are
        valid after the next fence)."""
        self._unfilled.difference_update(hashes)

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

    def shutdown(self) -> None:
        """Call once when the engine stops, between steps: waits for the disk reads, writes
        every CPU-tier block not on disk yet down to disk (when there is a disk tier; the
        least recently used first, so a full disk keeps the hottest), waits for the writes and
        stops the threads. The store is unusable afterwards. Device blocks are not included:
        control.persist(core) pushes those down first."""
        if self._closed:
            return
        self.fence()
        self.wait_loads()
        if self.disk is not None:
            self.cpu.evict(len(self.cpu))  # unpinned blocks cascade to disk in policy order
            for h in self.cpu.keys():  # still pinned (a waiting request holds it): copy it down
                if h not in self._unfilled and not self.disk.contains(h):
                    slot = self.cpu.slot_of(h)
                    self.disk.store([h], self.cpu.pool[slot:slot + 1])
        self.close()

    def close(self) -> None:
        """Lets disk reads in flight finish, joins the reader threads, finishes queued disk
        work and stops the writer thread (blocks in memory are lost: shutdown() keeps them)."""
        self._closed = True
        if self.disk is not None:
            self.wait_loads()
            self.disk.close()

    def clear(self, tier: str | None = None) -> None:
        """Drops blocks without cascading: one tier by name, or all of them (blocks pinned in the
        CPU tier stay)."""
        self.fence()
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
