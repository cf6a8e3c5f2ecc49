"""Which backend holds which prefix-cache block, from their KV events."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from shoal.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from shoal.kv_cache.hashing import BlockHash


class PrefixIndex:
    def __init__(self) -> None:
        self._where: dict[BlockHash, set[int]] = {}  # block hash -> backend ids
        self._held: dict[int, set[BlockHash]] = {}  # backend id -> its block hashes

    def apply(self, backend: int, events: Iterable[KVEvent]) -> None:
        held = self._held.setdefault(backend, set())
        for ev in events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    self._where.setdefault(h, set()).add(backend)
                    held.add(h)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._drop(backend, h)
                    held.discard(h)
            elif isinstance(ev, AllBlocksCleared):
                self.clear(backend)

    def clear(self, backend: int) -> None:
        """Forgets a backend's blocks (it reset its cache, or restarted)."""
        for h in self._held.pop(backend, set()):
            self._drop(backend, h)

    def _drop(self, backend: int, h: BlockHash) -> None:
        owners = self._where.get(h)
        if owners is not None:
            owners.discard(backend)
            if not owners:
                del self._where[h]

    def num_blocks(self, backend: int) -> int:
        return len(self._held.get(backend, ()))

    def match(self, hashes: Sequence[BlockHash]) -> dict[int, int]:
        """Backend id -> how many leading blocks of `hashes` it holds (backends with none
        are left out): an engine's prefix hit stops at its first missing block."""
        out: dict[int, int] = {}
        alive: set[int] | None = None
        for i, h in enumerate(hashes):
            owners = self._where.get(h, set())
            alive = set(owners) if alive is None else alive & owners
            if not alive:
                break
            for b in alive:
                out[b] = i + 1
        return out
