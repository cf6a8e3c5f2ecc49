"""A third tier for the tests: blocks kept in a dict, standing in for a remote store. It is
what a new lower tier takes: this one file, plus its line in lower_tiers.LOWER_TIERS
(the tests add it there with monkeypatch)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shoal.kv_cache.hashing import BlockHash
from shoal.kv_offload.layout import BlockLayout
from shoal.kv_offload.policy import make_policy
from shoal.kv_offload.tier import LowerTier, ReadOutcome, ReadResult, TierContext

NAME = "memory"


def build_memory_tier(ctx: TierContext) -> MemoryTier:
    """As large as four CPU tiers."""
    blocks = 4 * ctx.config.cpu_bytes // ctx.layout.nbytes
    return MemoryTier(ctx.layout, blocks)


class MemoryTier(LowerTier):
    name = NAME

    def __init__(self, layout: BlockLayout, capacity_blocks: int):
        super().__init__(layout, capacity_blocks, layout.nbytes,
                         make_policy("lru", capacity_blocks))
        self.blocks: dict[BlockHash, torch.Tensor] = {}
        self.reads = 0

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def keys(self) -> list[BlockHash]:
        return list(self.blocks)

    def read_into(self, block_hash: BlockHash, dst: torch.Tensor) -> ReadResult:
        block = self.blocks.get(block_hash)
        if block is None:
            return ReadOutcome.MISSING, "gone"
        dst.copy_(block)
        self.reads += 1
        return ReadOutcome.OK, ""

    def load(self, hashes: Sequence[BlockHash], dst: torch.Tensor) -> int:
        n = 0
        for i, h in enumerate(hashes):
            if not self.settle(h, self.read_into(h, dst[i])):
                break
            n += 1
        return n

    def store(self, hashes: Sequence[BlockHash], src: torch.Tensor) -> int:
        n = 0
        for i, h in enumerate(hashes):
            if h in self.blocks:
                self.touch(h)
            else:
                self.policy.prepare(h)
                while len(self.blocks) >= self.capacity_blocks and self.evict(1):
                    pass
                if len(self.blocks) >= self.capacity_blocks:
                    break
                self.blocks[h] = src[i].clone()
                self.policy.insert(h)
                self.stats.blocks_stored += 1
            n += 1
        self._sync_usage()
        return n

    def remove(self, block_hash: BlockHash) -> bool:
        if self.blocks.pop(block_hash, None) is None:
            return False
        self.policy.remove(block_hash)
        self._sync_usage()
        return True

    def evict(self, num_blocks: int) -> int:
        n = 0
        while n < num_blocks and (victim := self.policy.evict(lambda _: True)) is not None:
            del self.blocks[victim]
            self.stats.evictions += 1
            n += 1
        self._sync_usage()
        return n
