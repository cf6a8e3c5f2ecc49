"""The CPU tier of blocks whose pages differ in shape (BlockLayout.grouped, copied by
grouped_transfer.py): a partitioned pool's (DeepSeek-V4: KV cache groups whose layers' rows
differ, each with a partition of the device pool, shoal/worker/kv_cache_tensors.py), where a
block of group g is group_bytes[g] bytes, so each group gets slots of its own size instead of
every block taking the largest group's; or one group's of mixed rows (DeepSeek-V3.2), one
size of slots holding them as bytes.

The host memory is split between the groups as the device pool is (shares: each partition's
bytes over the pool's), so the tier is a scaled image of the device cache, and each group
evicts only its own blocks, by a policy of its own: the window groups' blocks, most of which
no hit reads again, cannot push out the compressed entries a long prefix needs. Slot ids stay
one range ([base_g, base_g + n_g) for group g), so the store, the connector and the plans
name slots as for one kind of block."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import torch

from shoal.kv_cache.hashing import BlockHash
from shoal.kv_offload.cpu_tier import CPUTier
from shoal.kv_offload.layout import BlockLayout
from shoal.kv_offload.policy import CanEvict, EvictionPolicy, Key, make_policy
from shoal.kv_offload.tier import KVTier


class GroupPolicies(EvictionPolicy):
    """One policy per KV cache group, keys routed by their group (BlockLayout.group_of).
    `evict` takes from the first group that gives a victim (flushes); a group that needs
    room evicts through `of_group`."""

    def __init__(self, layout: BlockLayout, policies: Sequence[EvictionPolicy]):
        super().__init__(sum(p.capacity for p in policies))
        self.layout = layout
        self.policies = list(policies)

    def of_group(self, group: int) -> EvictionPolicy:
        return self.policies[group]

    def _of(self, key: Key) -> EvictionPolicy:
        return self.policies[self.layout.group_of(key)]  # type: ignore[arg-type]

    def prepare(self, key: Key) -> None:
        self._of(key).prepare(key)

    def insert(self, key: Key) -> None:
        self._of(key).insert(key)

    def touch(self, key: Key) -> None:
        self._of(key).touch(key)

    def remove(self, key: Key) -> None:
        self._of(key).remove(key)

    def evict(self, can_evict: CanEvict) -> Key | None:
        for p in self.policies:
            victim = p.evict(can_evict)
            if victim is not None:
                return victim
        return None

    def __len__(self) -> int:
        return sum(len(p) for p in self.policies)


def group_slots(layout: BlockLayout, capacity_bytes: int, shares: Sequence[float]) -> list[int]:
    """Slots of each group: its share of the bytes, in blocks of its size. Raises when a group
    gets none (its blocks could never be kept, so no hit would ever need them all)."""
    if len(shares) != len(layout.group_bytes) or min(shares) <= 0:
        raise ValueError(f"one positive share per KV cache group needed ({len(layout.group_bytes)} "
                         f"groups, shares {list(shares)})")
    total = sum(shares)
    counts = [int(capacity_bytes * s / total) // b for s, b in zip(shares, layout.group_bytes)]
    if min(counts) < 1:
        g = counts.index(0)
        need = layout.group_bytes[g] * total / shares[g]
        raise ValueError(f"kv_offloading_size ({capacity_bytes / 2**30:.6f} GiB) gives KV cache "
                         f"group {g} no block of its {layout.group_bytes[g]} bytes (its share is "
                         f"{shares[g] / total:.3f} of the tier, as of the device pool); it needs "
                         f"at least {need / 2**30:.6f} GiB")
    return counts


class GroupedCPUTier(CPUTier):
    def __init__(self, layout: BlockLayout, capacity_bytes: int, policy: str,
                 shares: Sequence[float], pin_memory: bool | None = None):
        """policy: the eviction policy's name (each group gets one); shares: what part of
        capacity_bytes each group gets (proportions)."""
        if not layout.group_bytes:
            raise ValueError("GroupedCPUTier needs a partitioned pool's layout "
                             "(BlockLayout.grouped)")
        counts = group_slots(layout, capacity_bytes, shares)
        policies = GroupPolicies(layout, [make_policy(policy, n) for n in counts])
        # (not CPUTier.__init__: its one pool of equal slots is what this replaces)
        KVTier.__init__(self, layout, sum(counts), layout.nbytes, policies)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        # group g's slots: [bases[g], bases[g] + counts[g]), rows of pools[g]
        self.bases = [sum(counts[:g]) for g in range(len(counts))]
        self.pools = [torch.empty((n, b), dtype=torch.uint8, pin_memory=pin_memory)
                      for n, b in zip(counts, layout.group_bytes)]
        self._frees = [list(range(base + n - 1, base - 1, -1))
                       for base, n in zip(self.bases, counts)]
        self._used = 0
        self.stats.capacity_bytes = sum(n * b for n, b in zip(counts, layout.group_bytes))
        self._init_index()

    @property
    def capacity_bytes(self) -> int:
        return self.stats.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._used

    def group_of_slot(self, slot: int) -> int:
        return bisect_right(self.bases, slot) - 1

    def payload(self, slot: int) -> torch.Tensor:
        """The slot's block: [group_bytes[g]] bytes of its group's pool."""
        g = self.group_of_slot(slot)
        return self.pools[g][slot - self.bases[g]]

    def _take_slot(self, block_hash: BlockHash) -> int | None:
        g = self.layout.group_of(block_hash)
        free = self._frees[g]
        policy = self.policy.of_group(g)  # type: ignore[attr-defined]
        while not free:
            if not self._evict_one(policy):
                return None
        self._used += self.layout.group_bytes[g]
        return free.pop()

    def _release_slot(self, slot: int, block_hash: BlockHash) -> None:
        g = self.group_of_slot(slot)
        self._used -= self.layout.group_bytes[g]
        self._frees[g].append(slot)

    def _free_slots(self) -> list[int]:
        return [s for free in self._frees for s in free]

    def check(self) -> None:
        super().check()
        for h, slot in self._slot.items():
            assert self.group_of_slot(slot) == self.layout.group_of(h), "a block in another " \
                "group's slot"
        assert self._used == sum(self.layout.payload_bytes(h) for h in self._slot), "used bytes"
