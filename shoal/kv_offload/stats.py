"""Per-tier counters, as plain dataclasses the metrics layer can read (no torch, no locks)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TierStats:
    """Cumulative since start-up. Queries and hits count blocks looked up and found (once per
    admission attempt of a request, not again while it waits for a disk read). For the CPU
    tier, loads and stores are the device <-> CPU copies; for the disk tier, file reads (into
    the CPU tier) and file writes. Disk load seconds are wall time with at least one
    background read running (not a sum over reader threads)."""

    name: str
    capacity_bytes: int
    used_bytes: int = 0
    queries: int = 0
    hits: int = 0
    blocks_loaded: int = 0
    bytes_loaded: int = 0
    load_seconds: float = 0.0
    blocks_stored: int = 0
    bytes_stored: int = 0
    store_seconds: float = 0.0
    evictions: int = 0
    damaged: int = 0  # entries found damaged at load, dropped and treated as misses

    @property
    def usage(self) -> float:
        return self.used_bytes / self.capacity_bytes if self.capacity_bytes else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def as_metrics(self) -> dict[str, float]:
        """The cumulative figures the metrics layer exports, by name."""
        return {
            "usage": self.usage, "queries": self.queries, "hits": self.hits,
            "bytes_loaded": self.bytes_loaded, "load_seconds": self.load_seconds,
            "bytes_stored": self.bytes_stored, "store_seconds": self.store_seconds,
            "evictions": self.evictions, "damaged": self.damaged,
        }

    def record_load(self, num_blocks: int, nbytes: int, seconds: float) -> None:
        self.blocks_loaded += num_blocks
        self.bytes_loaded += nbytes
        self.load_seconds += seconds

    def record_store(self, num_blocks: int, nbytes: int, seconds: float) -> None:
        self.blocks_stored += num_blocks
        self.bytes_stored += nbytes
        self.store_seconds += seconds


@dataclass
class KVOffloadStats:
    tiers: list[TierStats] = field(default_factory=list)  # fastest first: cpu, then disk

    def tier(self, name: str) -> TierStats | None:
        return next((t for t in self.tiers if t.name == name), None)
