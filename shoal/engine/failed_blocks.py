"""Keeping non-finite KV values away from everyone else (the scheduler's; its step-fault
recovery is in scheduler.py).

Non-finite values in a request's KV blocks must not reach anyone else: padding positions of
a later owner's blocks enter attention as 0 * NaN = NaN, and a prefix-cache hit would read
them outright. So a failed request's blocks leave the prefix cache (and the KV tiers) and are
zeroed. Only the scheduler knows who owns a block by the time the failure is known: with
async scheduling the request may have been preempted, aborted or finished in the meantime
and its blocks handed to another request, which has already written some of their slots.
Blocks released while a step holding their request was in flight are remembered until that
step's results arrive; then a block nobody owns is zeroed whole, a block reused by a new owner
only in the slots that owner has not written yet, and a block another request holds as a
prefix hit is only withdrawn from the cache. The runner zeroes them at the start of the next
step (`SchedulerOutput.kv_zero`), before that step writes anything."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.core.request import Request
from shoal.kv_cache.block_pool import KVBlock
from shoal.kv_cache.hashing import BlockHash
from shoal.kv_cache.manager import KVCacheManager
from shoal.kv_offload.connector import KVOffloadConnector


@dataclass
class _Released:
    """Blocks a request let go of while steps holding it were still in flight."""

    blocks: list[tuple[KVBlock, BlockHash | None]]  # the block and its hash when released
    in_flight: int  # sampling steps of the request whose results are still to come


class FailedBlocks:
    def __init__(self, kv: KVCacheManager, offload: KVOffloadConnector | None,
                 running: list[Request]):
        """running: the scheduler's running requests (the owners of reused blocks)."""
        self.kv, self.offload, self.running = kv, offload, running
        self._released: dict[int, _Released] = {}  # by request serial
        self._to_zero: list[tuple[int, int]] = []  # (block id, first slot) for the runner

    def release(self, req: Request, failed: bool) -> None:
        """Frees a request's blocks; a failed request's are withdrawn and zeroed. Blocks
        released while a step holding the request is in flight are remembered for its result."""
        blocks = [b for _, b in self.kv.request_blocks(req.request_id)]
        if req.num_pending_tokens > 0 and blocks:
            self._released[req.serial] = _Released([(b, b.block_hash) for b in blocks],
                                                   req.num_pending_tokens)
        if not failed:
            self.kv.free(req)
            return
        # Blocks it holds alone are its own work; shared ones are others' prefix hits.
        own = [b for b in blocks if b.ref_cnt == 1]
        self._discard_from_tiers([b.block_hash for b in own if b.block_hash is not None])
        self.kv.free(req, failed=True)  # withdraws `own` from the prefix cache
        self._to_zero.extend((b.block_id, 0) for b in own)  # before anyone's next write

    @property
    def pending(self) -> bool:
        """Blocks released while their request's steps are in flight, awaiting results."""
        return bool(self._released)

    def settle(self, serial: int, failed: bool) -> None:
        """A sampling step of a request that released blocks while it ran has its result."""
        entry = self._released.get(serial)
        if entry is None:
            return
        if failed:
            self._taint(entry)
        entry.in_flight -= 1
        if entry.in_flight <= 0 or failed:
            del self._released[serial]

    def _taint(self, entry: _Released) -> None:
        owners = None  # block id -> (request, index in its table), built when first needed
        for block, h in entry.blocks:
            same_content = h is not None and block.block_hash == h
            if h is not None:
                self._discard_from_tiers([h])
            if block.ref_cnt == 0:
                self.kv.pool.uncache_block(block)
                self._to_zero.append((block.block_id, 0))
                continue
            if same_content:  # held as a prefix hit: keep it for them, find it no more
                self.kv.pool.uncache_block(block)
                continue
            if owners is None:
                owners = self._block_owners()
            owner = owners.get(block.block_id)
            if owner is not None:  # reused: zero the slots its new owner has not written
                req, index = owner
                written = req.num_computed_tokens - index * self.kv.block_size
                if written < self.kv.block_size:
                    self._to_zero.append((block.block_id, max(0, written)))

    def _block_owners(self) -> dict[int, tuple[Request, int]]:
        owners: dict[int, tuple[Request, int]] = {}
        for req in self.running:
            for i, b in self.kv.request_blocks(req.request_id):
                owners.setdefault(b.block_id, (req, i))
        return owners

    def _discard_from_tiers(self, hashes: list[BlockHash]) -> None:
        if self.offload is not None and hashes:
            self.offload.discard(hashes)

    def take_zero(self) -> list[tuple[int, int]]:
        """(block id, first slot) for the runner to zero before the next step writes."""
        out, self._to_zero = self._to_zero, []
        return out
