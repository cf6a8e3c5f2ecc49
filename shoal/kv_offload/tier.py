"""The interface every secondary KV tier implements.

Blocks are addressed by their content hash (the chained prefix hash of the device prefix
cache), so a hit in any tier is the same bytes the device would have computed. Payloads
cross the interface as CPU tensors shaped [n, *BlockLayout.block_shape]; a partitioned
pool's (BlockLayout.grouped, DeepSeek-V4) one block at a time, as [payload_bytes(key)]
uint8: a size per KV cache group.

The first tier of a store is the CPU tier (cpu_tier.py): the only one the device copies
with. Every tier below it is a `LowerTier`: its blocks are read into a CPU-tier slot in the
background (`read_async`, then `settle` on the scheduler's thread) before the device sees
them. A new lower tier is one file with a `LowerTier` subclass and a builder taking a
`TierContext`, plus its line in lower_tiers.py.

Imports no torch at run time (tensors appear in type hints only): the store and the
scheduler import this module."""

from __future__ import annotations

import enum
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shoal.kv_cache.hashing import BlockHash
from shoal.kv_offload.policy import EvictionPolicy
from shoal.kv_offload.stats import TierStats

if TYPE_CHECKING:
    import torch

    from shoal.config import KVOffloadConfig
    from shoal.kv_offload.layout import BlockLayout, StoreKey

logger = logging.getLogger(__name__)


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

    def touch(self, block_hash: BlockHash) -> None:
        """A use of a held block (recency for the policy)."""
        self.policy.touch(block_hash)

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

    # -- background work ----------------------------------------------------------------------
    def drain(self) -> None:  # noqa: B027 - optional: tiers that write in the background
        """Waits for queued writes and deletions."""

    def close(self) -> None:  # noqa: B027 - optional: tiers with threads or connections
        """Finishes queued work and stops the tier's threads; it is unusable afterwards."""

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


class ReadOutcome(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # not there any more (deleted behind our back): a plain miss
    DAMAGED = "damaged"  # failed a check: the block is dropped
    FAILED = "failed"  # anything else went wrong: treated as damaged, logged with its cause


ReadResult = tuple[ReadOutcome, str]  # (outcome, why)


class LowerTier(KVTier):
    """A tier below the CPU tier. Reads come in two halves so they can run off the
    scheduler's thread: `read_into` (block -> host memory, verified; touches no state of the
    tier, any thread) and `settle` (index, policy and statistics, on the scheduler's thread).
    By default `read_async` runs the read at once; a tier with its own threads or network
    client overrides it and reports its reading time through `take_read_seconds`."""

    def __init__(self, layout: BlockLayout, capacity_blocks: int, entry_bytes: int,
                 policy: EvictionPolicy):
        super().__init__(layout, capacity_blocks, entry_bytes, policy)
        self._read_seconds = 0.0

    @abstractmethod
    def read_into(self, block_hash: BlockHash, dst: torch.Tensor) -> ReadResult:
        """Copies one block into dst ([*block_shape]) and verifies it; dst holds garbage
        unless the outcome is OK. Must not raise for a bad block: return its outcome."""

    def read_async(self, block_hash: BlockHash, dst: torch.Tensor) -> Future[ReadResult]:
        """`read_into`, finished when the future is; settle the result on the owning thread."""
        t0 = time.perf_counter()
        future: Future[ReadResult] = Future()
        future.set_result(self.read_into(block_hash, dst))
        self._read_seconds += time.perf_counter() - t0
        return future

    def take_read_seconds(self) -> float:
        """Reading time since the last call: wall time with a read running, not a sum over
        parallel reads, so bytes loaded / load seconds is the bandwidth delivered."""
        s, self._read_seconds = self._read_seconds, 0.0
        return s

    def settle(self, block_hash: BlockHash, result: ReadResult) -> bool:
        """Applies a read's outcome to the index and statistics (not bytes or seconds: the
        caller counts those); True when the block arrived intact. A block that failed is
        dropped, never served again: its request recomputes from there."""
        outcome, why = result
        if outcome is ReadOutcome.OK:  # (evicted meanwhile: the bytes read are still right)
            if self.contains(block_hash):
                self.touch(block_hash)
            return True
        if outcome is ReadOutcome.DAMAGED:
            self.stats.damaged += 1
            logger.warning("%s KV block %s is damaged (%s): dropped, will recompute", self.name,
                           block_hash.hex(), why)
        elif outcome is ReadOutcome.FAILED:
            logger.error("reading %s KV block %s failed (%s): dropped, will recompute",
                         self.name, block_hash.hex(), why)
        self.remove(block_hash)
        return False


@dataclass(frozen=True)
class TierContext:
    """What a lower tier's builder gets: the offloading settings, the byte layout of a block
    and the identity stored blocks must match (model, dtype, block size, shapes)."""

    config: KVOffloadConfig
    layout: BlockLayout
    key: StoreKey
