"""The CPU tier: one preallocated pool of block slots in host memory (pinned when CUDA is
available, so device copies can be asynchronous). The first tier of every store, and the
only one the device copies with: blocks of the lower tiers are read into its slots.

Besides the generic load/store, the device side works on slots directly: `reserve` hands out
a slot for a block the model runner will copy in later, and pins keep a slot from being
evicted (or cascaded to a lower tier) while a copy into or out of it is in flight.

A partitioned pool's blocks differ in size by KV cache group: GroupedCPUTier
(grouped_cpu_tier.py) keeps a pool of slots per group, through the hooks below (payload,
_free_for, _policy_for, _release_slot)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

import torch

from shoal.kv_cache.hashing import BlockHash
from shoal.kv_offload.layout import BlockLayout
from shoal.kv_offload.policy import EvictionPolicy
from shoal.kv_offload.tier import KVTier

# Called with (hash, payload view) just before an evicted block's slot is reused.
EvictHook = Callable[[BlockHash, torch.Tensor], None]


class CPUTier(KVTier):
    name = "cpu"

    def __init__(self, layout: BlockLayout, capacity_bytes: int, policy: EvictionPolicy,
                 pin_memory: bool | None = None):
        num_slots = max(0, capacity_bytes // layout.nbytes)
        super().__init__(layout, num_slots, layout.nbytes, policy)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self.pool = torch.empty((num_slots, *layout.block_shape), dtype=layout.dtype,
                                pin_memory=pin_memory and num_slots > 0)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._init_index()

    def _init_index(self) -> None:
        self._slot: dict[BlockHash, int] = {}
        self._pins: Counter[BlockHash] = Counter()
        self.on_evict: EvictHook | None = None

    # -- queries ------------------------------------------------------------------------------
    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self._slot

    def __len__(self) -> int:
        return len(self._slot)

    def keys(self) -> list[BlockHash]:
        return list(self._slot)

    def slot_of(self, block_hash: BlockHash) -> int:
        return self._slot[block_hash]

    # -- pins ---------------------------------------------------------------------------------
    def pin(self, block_hash: BlockHash) -> None:
        if block_hash not in self._slot:
            raise KeyError(f"cannot pin a block the CPU tier does not hold: {block_hash.hex()}")
        self._pins[block_hash] += 1

    def unpin(self, block_hash: BlockHash) -> None:
        if self._pins[block_hash] <= 0:
            raise RuntimeError(f"unbalanced unpin of {block_hash.hex()}")
        self._pins[block_hash] -= 1
        if not self._pins[block_hash]:
            del self._pins[block_hash]

    def is_pinned(self, block_hash: BlockHash) -> bool:
        return self._pins[block_hash] > 0

    def num_pinned(self) -> int:
        return len(self._pins)

    def _evictable(self, block_hash: BlockHash) -> bool:
        return not self._pins[block_hash]

    # -- slots --------------------------------------------------------------------------------
    def payload(self, slot: int) -> torch.Tensor:
        """The slot's block (a view of the pool): [*layout.block_shape]."""
        return self.pool[slot]

    def _take_slot(self, block_hash: BlockHash) -> int | None:
        """A free slot for the block, made by evicting per the policy; None when every slot
        it could take is pinned."""
        while not self._free:
            if not self._evict_one():
                return None
        return self._free.pop()

    def _release_slot(self, slot: int, block_hash: BlockHash) -> None:
        self._free.append(slot)

    def _free_slots(self) -> list[int]:
        return self._free

    def reserve(self, block_hash: BlockHash) -> int | None:
        """A slot for a block not held yet, made by evicting per the policy (victims cascade
        through on_evict). The caller fills it; None when every slot is pinned."""
        if block_hash in self._slot:
            raise ValueError(f"block {block_hash.hex()} is already in the CPU tier")
        if not self.capacity_blocks:
            return None
        self.policy.prepare(block_hash)
        slot = self._take_slot(block_hash)
        if slot is None:
            return None
        self._slot[block_hash] = slot
        self.policy.insert(block_hash)
        self._sync_usage()
        return slot

    def _evict_one(self, policy: EvictionPolicy | None = None) -> bool:
        victim = (policy or self.policy).evict(self._evictable)
        if victim is None:
            return False
        slot = self._slot.pop(victim)
        if self.on_evict is not None:
            self.on_evict(victim, self.payload(slot))
        self._release_slot(slot, victim)
        self.stats.evictions += 1
        self._sync_usage()
        return True

    # -- KVTier -------------------------------------------------------------------------------
    def load(self, hashes: Sequence[BlockHash], dst: torch.Tensor) -> int:
        t0 = time.perf_counter()
        n = 0
        for i, h in enumerate(hashes):
            slot = self._slot.get(h)
            if slot is None:
                break
            dst[i].copy_(self.payload(slot))
            self.policy.touch(h)
            n += 1
        self.stats.record_load(n, sum(map(self.layout.payload_bytes, hashes[:n])),
                               time.perf_counter() - t0)
        return n

    def store(self, hashes: Sequence[BlockHash], src: torch.Tensor) -> int:
        t0 = time.perf_counter()
        n = stored = nbytes = 0
        for i, h in enumerate(hashes):
            if h in self._slot:
                self.policy.touch(h)
            else:
                slot = self.reserve(h)
                if slot is None:
                    break
                self.payload(slot).copy_(src[i])
                stored += 1
                nbytes += self.layout.payload_bytes(h)
            n += 1
        self.stats.record_store(stored, nbytes, time.perf_counter() - t0)
        return n

    def remove(self, block_hash: BlockHash) -> bool:
        slot = self._slot.pop(block_hash, None)
        if slot is None:
            return False
        if self._pins.get(block_hash):
            self._slot[block_hash] = slot
            raise RuntimeError(f"cannot remove pinned block {block_hash.hex()}")
        self.policy.remove(block_hash)
        self._release_slot(slot, block_hash)
        self._sync_usage()
        return True

    def evict(self, num_blocks: int) -> int:
        n = 0
        while n < num_blocks and self._slot and self._evict_one():
            n += 1
        return n

    def clear(self) -> None:
        for h in [h for h in self._slot if self._evictable(h)]:
            self.remove(h)

    def check(self) -> None:
        """Invariants, for tests: every slot is either free or holds exactly one block."""
        used = sorted(self._slot.values())
        assert len(set(used)) == len(used), "a slot holds two blocks"
        assert sorted(used + self._free_slots()) == list(range(self.capacity_blocks)), "slot leak"
        assert len(self.policy) == len(self._slot), "policy and tier disagree"
        assert all(h in self._slot for h in self._pins), "a pin outlived its block"
