"""The interface every secondary KV tier implements.

Blocks are addressed by their content hash (the chained prefix hash of the device prefix
cache), so a hit in any tier is the same bytes the device would have computed. Payloads
cross the interface as CPU tensors shaped [n, *BlockLayout.block_shape]."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from shoal.kv_cache.hashing import BlockHash
from shoal.kv_offload.layout import BlockLayout
from shoal.kv_offload.policy import EvictionPolicy
from shoal.kv_offload.stats import TierStats


class KVTier(ABC):
    name: str

    def __init__(self, layout: BlockLayout, capacity_blocks: int, entry_bytes: int,
                 policy: EvictionPolicy):
        self.layout = layout
        self.capacity_blocks = max(0, capacity_blocks)
        self.entry_bytes = entry_bytes  # bytes one block takes in this tier
        self.policy = policy
        self.stats = TierStats(self.name, self.capacity_blocks * entry_bytes)

    # -- queries ------------------------------------------------------------------------------
    @abstractmethod
    def contains(self, block_hash: BlockHash) -> bool:
        """Is the block here (no statistics, no recency update)?"""

    @abstractmethod
    def __len__(self) -> int:
        """Blocks held."""

    def lookup(self, hashes: Sequence[BlockHash]) -> int:
        """Number of leading hashes held here; counted in the stats."""
        n = 0
        for h in hashes:
            self.stats.queries += 1
            if not self.contains(h):
                break
            self.stats.hits += 1
            n += 1
        return n

    # -- data ---------------------------------------------------------------------------------
    @abstractmethod
    def load(self, hashes: Sequence[BlockHash], dst: torch.Tensor) -> int:
        """Copies the leading blocks into dst[i]; returns how many arrived intact. A block
        that is missing or damaged ends the run (damaged ones are dropped, never served)."""

    @abstractmethod
    def store(self, hashes: Sequence[BlockHash], src: torch.Tensor) -> int:
        """Stores src[i] under hashes[i] (already held ones are only touched), evicting by the
        policy to stay within capacity; returns how many are now held."""

    @abstractmethod
    def remove(self, block_hash: BlockHash) -> bool:
        """Drops one block if held (not an eviction: nothing cascades)."""

    @abstractmethod
    def evict(self, num_blocks: int) -> int:
        """Evicts up to num_blocks by the policy (cascading where the tier does); returns how
        many went."""

    def clear(self) -> None:
        for h in list(self.keys()):
            self.remove(h)

    @abstractmethod
    def keys(self) -> list[BlockHash]:
        """Hashes held (any order)."""

    # -- size accounting ----------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self.capacity_blocks * self.entry_bytes

    @property
    def used_bytes(self) -> int:
        return len(self) * self.entry_bytes

    def usage(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0

    def check(self) -> None:  # noqa: B027 - optional
        """Asserts the tier's invariants (tests)."""

    def _sync_usage(self) -> None:
        self.stats.used_bytes = self.used_bytes
