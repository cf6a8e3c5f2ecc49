"""What the scheduler does when a step goes wrong: non-finite logits, or a step that raised.

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
step (`SchedulerOutput.kv_zero`), before that step writes anything.

A step that raises (a bug or a bad combination of inputs in the runner) must not take the
engine down or fail requests that had nothing to do with it. The requests of that step are
put back to wait, marked as suspects, and rerun one at a time ("isolated"): a suspect runs
alone until it has produced a token again. One that raises while alone fails with the error;
one seen in two failing steps stays isolated until it ends, so a request that fails only in
batches cannot loop forever."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from shoal.core.errors import ErrorCode
from shoal.core.request import Request, RequestStatus
from shoal.core.types import EngineCoreOutput
from shoal.kv_cache.block_pool import KVBlock
from shoal.kv_cache.hashing import BlockHash

if TYPE_CHECKING:
    from shoal.core.scheduler_output import SchedulerOutput

# A request in this many failing steps stays isolated until it ends.
ISOLATE_FOR_GOOD_AFTER = 2


@dataclass
class _Released:
    """Blocks a request let go of while steps holding it were still in flight."""

    blocks: list[tuple[KVBlock, BlockHash | None]]  # the block and its hash when released
    in_flight: int  # sampling steps of the request whose results are still to come


class FaultHandling:
    """Mixed into Scheduler: bookkeeping for failed requests and steps that raised."""

    def _init_faults(self) -> None:
        self._released: dict[int, _Released] = {}  # by request serial
        self._to_zero: list[tuple[int, int]] = []  # (block id, first slot) for the runner
        self._isolated: Request | None = None  # the suspect running alone
        self.num_failed_steps = 0

    # ---- blocks -------------------------------------------------------------------------------
    def _release_blocks(self, req: Request, failed: bool) -> None:
        """Frees a request's blocks; a failed request's are withdrawn and zeroed. Blocks
        released while a step holding the request is in flight are remembered for its result."""
        blocks = self.kv.req_blocks.get(req.request_id, [])
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

    def _settle_released(self, serial: int, failed: bool) -> None:
        """A sampling step of a request that released blocks while it ran has its result."""
        entry = self._released.get(serial)
        if entry is None:
            return
        if failed:
            self._taint_released(entry)
        entry.in_flight -= 1
        if entry.in_flight <= 0 or failed:
            del self._released[serial]

    def _taint_released(self, entry: _Released) -> None:
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
                written = req.num_computed_tokens - index * self.block_size
                if written < self.block_size:
                    self._to_zero.append((block.block_id, max(0, written)))

    def _block_owners(self) -> dict[int, tuple[Request, int]]:
        owners: dict[int, tuple[Request, int]] = {}
        for req in self.running:
            for i, b in enumerate(self.kv.req_blocks.get(req.request_id, ())):
                owners.setdefault(b.block_id, (req, i))
        return owners

    def _discard_from_tiers(self, hashes: list[BlockHash]) -> None:
        if self.offload is not None and hashes:
            self.offload.discard(hashes)

    def _take_zero(self, out: SchedulerOutput) -> None:
        if self._to_zero:
            out.kv_zero, self._to_zero = self._to_zero, []

    # ---- steps that raised ------------------------------------------------------------------
    def fail_steps(self, scheds: list[SchedulerOutput], error: str
                   ) -> tuple[list[EngineCoreOutput], set[int]]:
        """Steps that raised and will never be updated. Their requests go back to wait as
        suspects (their blocks withdrawn: what the steps wrote is unknown), or fail when they
        were alone. Returns the error outputs and the serials whose runner state must go."""
        self.num_failed_steps += 1
        plan_ids = [s.kv_transfers.plan_id for s in scheds if s.kv_transfers is not None]
        if self.offload is not None and plan_ids:
            self.offload.transfers_failed(plan_ids)
        serials: set[int] = set()
        for s in scheds:
            for it in s.scheduled:
                serials.add(it.serial)
                req = self._by_serial.get(it.serial)
                if it.sample and req is not None:
                    req.num_pending_tokens -= 1
                if it.sample:
                    self._settle_released(it.serial, failed=True)
        outputs: list[EngineCoreOutput] = []
        for serial in sorted(serials):
            req = self._by_serial.get(serial)
            if req is None:
                continue
            req.num_faults += 1
            if len(serials) == 1:
                self._end(req, RequestStatus.FINISHED_ERROR)
                outputs.append(EngineCoreOutput(
                    req.request_id, [], finish_reason="error",
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                    error=f"the engine failed while running this request: {error}",
                    error_code=ErrorCode.ENGINE_FAILED))
            else:
                self._requeue_suspect(req)
        return outputs, serials

    def _requeue_suspect(self, req: Request) -> None:
        """Back to the front of the queue, its runner state to be sent again; runs alone."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
            self.waiting.push_front(req)
        self._release_blocks(req, failed=True)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.suspect = True
        if req is self._isolated:
            self._isolated = None

    # ---- isolation ----------------------------------------------------------------------------
    def _schedule_isolated(self, step) -> bool:
        """True when this step belongs to a suspect alone (it may then run nothing at all)."""
        req = self._isolated
        if req is None:
            if not len(self.waiting):
                return False
            head = self.waiting.peek()
            if not head.suspect or head.num_pending_tokens:
                return False
            cached = self._find_cached(head)
            if cached is None or not self._admit(head, cached, step):
                return False
            self._isolated = head
            return True
        n = min(req.num_tokens_with_pending - req.num_computed_tokens, step.budget)
        if n > 0 and not self._waits_for_step(req):
            allocated, _ = self._allocate_running(req, n, step)
            if allocated:
                step.add(req, n)
        return True

    def _sampled_fine(self, req: Request) -> None:
        """A request produced a token: a suspect is cleared (unless isolated for good)."""
        if req.suspect and req.num_faults < ISOLATE_FOR_GOOD_AFTER:
            req.suspect = False
            if req is self._isolated:
                self._isolated = None

    def _left(self, req: Request) -> None:
        """The request stopped running (ended or preempted)."""
        if req is self._isolated:
            self._isolated = None
