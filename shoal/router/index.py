"""Which engine holds which prefix-cache block, from their KV events. A holder is any
hashable key: the router's is (backend id, replica index), so each data-parallel replica of a
backend has blocks of its own."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from shoal.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from shoal.kv_cache.hashing import BlockHash

Holder = Hashable


class PrefixIndex:
    def __init__(self) -> None:
        self._where: dict[BlockHash, set[Holder]] = {}  # block hash -> its holders
        self._held: dict[Holder, set[BlockHash]] = {}  # holder -> its block hashes

    def apply(self, holder: Holder, events: Iterable[KVEvent]) -> None:
        held = self._held.setdefault(holder, set())
        for ev in events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    self._where.setdefault(h, set()).add(holder)
                    held.add(h)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._drop(holder, h)
                    held.discard(h)
            elif isinstance(ev, AllBlocksCleared):
                self.clear(holder)

    def clear(self, holder: Holder) -> None:
        """Forgets a holder's blocks (it reset its cache, or restarted)."""
        for h in self._held.pop(holder, set()):
            self._drop(holder, h)

    def _drop(self, holder: Holder, h: BlockHash) -> None:
        owners = self._where.get(h)
        if owners is not None:
            owners.discard(holder)
            if not owners:
                del self._where[h]

    def num_blocks(self, holder: Holder) -> int:
        return len(self._held.get(holder, ()))

    def match(self, hashes: Sequence[BlockHash]) -> dict[Holder, int]:
        """Holder -> how many leading blocks of `hashes` it holds (holders with none are
        left out): an engine's prefix hit stops at its first missing block."""
        out: dict[Holder, int] = {}
        alive: set[Holder] | None = None
        for i, h in enumerate(hashes):
            owners = self._where.get(h, set())
            alive = set(owners) if alive is None else alive & owners
            if not alive:
                break
            for b in alive:
                out[b] = i + 1
        return out
