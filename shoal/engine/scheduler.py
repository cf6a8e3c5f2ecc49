"""Continuous batching with one token budget per step.

There are no prefill and decode phases: every step, running requests get their next tokens
(one for a decode, a chunk for an unfinished prefill), then waiting requests are admitted
while budget, sequence slots and KV blocks last. When blocks run out, the lowest-priority
running request is preempted: its blocks are freed and it is recomputed later from its
prompt plus the tokens it already produced, so its output does not change.

Pipeline parallelism keeps several steps in flight (micro-batches, see engine/step_queue.py):
then a request is never in two steps at once (its next input is the token its step in flight
samples), and each step takes about an even share of the requests, so the steps in flight
keep every stage busy.

What the scheduler owns: its live requests (request_table.py), the KV blocks (the KV cache
manager, and the KV tiers' connector), the admission of waiting requests (admission.py), how
many drafts a request verifies (draft_budget.py), and what a failure leaves behind:
non-finite KV values (failed_blocks.py) and the requests of a step that raised
(suspects.py)."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

from shoal.config import CacheConfig, SchedulerConfig
from shoal.core.errors import ErrorCode
from shoal.core.kv_cache_spec import FULL_ATTENTION, KVCacheGroup
from shoal.core.request import Request, RequestStatus
from shoal.core.scheduler_output import (
    PENDING_TOKEN,
    ScheduledRequest,
    SchedulerOutput,
)
from shoal.core.types import EngineCoreOutput, SchedulerStats
from shoal.engine.admission import Admission, StepPlan
from shoal.engine.draft_budget import DraftBudget, drafts_paused
from shoal.engine.encoder_schedule import EncoderSchedule
from shoal.engine.failed_blocks import FailedBlocks
from shoal.engine.request_table import (
    RequestTable,
    RequestTableFront,
    engine_failed_message,
    error_output,
)
from shoal.engine.scheduler_results import StepResults
from shoal.engine.scheduler_stats import add_feature_stats
from shoal.engine.step_rollback import roll_back
from shoal.engine.suspects import Suspects
from shoal.engine.waiting_queue import WaitingQueue
from shoal.kv_cache.manager import KVCacheManager
from shoal.kv_offload.connector import KVOffloadConnector
from shoal.kv_offload.store import TieredKVStore
from shoal.kv_transfer.base import KVConnector

logger = logging.getLogger(__name__)


class Scheduler(StepResults, RequestTableFront):
    def __init__(self, sched_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, kv_store: TieredKVStore | None = None,
                 request_timeout: float | None = None, num_speculative_tokens: int = 0,
                 spec_adaptive: bool = True, spec_disable_by_batch_size: int | None = None,
                 spec_confidence: float | None = None,
                 micro_batches: int = 1, kv_groups: Sequence[KVCacheGroup] = FULL_ATTENTION,
                 encoder_cache_size: int = 0, whole_spans: bool = False,
                 kv_connector: KVConnector | None = None, pipelined: bool = False):
        """num_blocks: the device KV pool, as the model runner sized it at start-up.
        request_timeout: seconds from arrival after which a request is ended with an error.
        num_speculative_tokens: drafts per step of a speculating request (0: none);
        spec_adaptive / spec_disable_by_batch_size / spec_confidence: see draft_budget.py.
        micro_batches: steps in flight at once (pipeline parallelism); above 1 a request
        waits while a step samples for it, and each step takes 1/micro_batches of them.
        kv_groups: the layers sharing block tables (the runner's KVCacheLayout).
        encoder_cache_size: images' encoder outputs the runner keeps (0: a text model);
        whole_spans: each image runs within one step (encoder_schedule.py).
        kv_connector: KV from and for other engines (shoal/kv_transfer).
        pipelined: a step may launch before the previous one's results are in (async
        scheduling): see drafts_paused."""
        self.config = sched_config
        self.pipelined = pipelined
        self.micro_batches = micro_batches
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching, kv_groups)
        # KV offloading: evicted device blocks go to the tiers, admissions load tier hits.
        self.offload = (KVOffloadConnector(kv_store, self.kv.pool, self.block_size,
                                           self.kv.tables)
                        if kv_store is not None else None)
        self._groups = len(kv_groups) > 1
        self._states = any(g.holds_state for g in kv_groups)
        self.table = RequestTable(request_timeout)
        self.waiting = WaitingQueue(sched_config.policy)
        self.running: list[Request] = []
        self.drafts = DraftBudget(num_speculative_tokens, sched_config.max_model_len,
                                  spec_adaptive, spec_disable_by_batch_size, spec_confidence)
        self.failed_blocks = FailedBlocks(self.kv, self.offload, self.running)
        self.suspects = Suspects(self.running, self.waiting, self.failed_blocks)
        self.encoders = (EncoderSchedule(encoder_cache_size, encoder_cache_size, whole_spans)
                         if encoder_cache_size else None)
        self.connector = kv_connector
        self.admission = Admission(sched_config, self.kv, self.offload, self.waiting,
                                   self.running, self.encoders, kv_connector)
        self.num_preemptions = 0
        self._step_prompt_tokens = 0
        self._step_generation_tokens = 0

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.table.add(req)  # gives it its serial
        self.waiting.push(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self.table.by_id.get(rid)
            if req is not None:
                self._end_between_steps(req, RequestStatus.FINISHED_ABORTED, "abort")

    def fail_request(self, req: Request, error: str) -> None:
        """Ends a live request that has not run with an error the client caused (its grammar
        does not compile): the frontends answer it as a bad request."""
        if self.table.is_live(req):  # else ended meanwhile
            self._end_between_steps(req, RequestStatus.FINISHED_ERROR, "error", error,
                                    ErrorCode.BAD_REQUEST)

    def _end_between_steps(self, req: Request, status: RequestStatus, reason: str,
                           error: str | None = None, code: ErrorCode | None = None) -> None:
        self._end(req, status)
        self.table.emit(EngineCoreOutput(
            request_id=req.request_id, new_token_ids=[], finish_reason=reason,
            num_cached_tokens=max(req.num_cached_tokens, 0), error=error, error_code=code))

    def _end(self, req: Request, status: RequestStatus) -> None:
        """Finishes a running request, or one waiting (preempted, perhaps while its last step
        was in flight)."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        if self.offload is not None:  # reads or pins it may hold while deferred
            self.offload.abandon(req.request_id)
        self.failed_blocks.release(req, failed=status == RequestStatus.FINISHED_ERROR)
        self.admission.on_end(req)
        self.table.remove(req)
        self.suspects.left(req)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self, allow_drafts: bool = True) -> SchedulerOutput:
        """One step: running requests first, then waiting ones while budget, sequence slots
        and blocks last; none are admitted in a step that had to preempt (memory is short).
        allow_drafts=False: no request verifies drafts (a step is in flight, see core.py)."""
        if self.offload is not None:
            self.offload.begin_step()
        for req in self.table.expired():
            self._end_between_steps(req, RequestStatus.FINISHED_ABORTED, "error",
                                    self.table.timeout_message(), ErrorCode.TIMED_OUT)
        step = StepPlan(budget=self.config.max_num_batched_tokens, allow_drafts=allow_drafts,
                        max_requests=self._micro_batch_size())
        if self.encoders is not None:
            self.encoders.begin_step()
        built: dict[int, ScheduledRequest] = {}
        try:
            if not self._schedule_isolated(step):  # a suspect of a failed step runs alone
                self._schedule_running(step)
                if not step.preempted:
                    self.admission.schedule_waiting(step)
            return self._build_output(step, built)
        except Exception as e:  # a bug met while handling one request: it alone fails
            culprit = step.current
            if culprit is None:
                raise  # between requests: the engine core's recovery (core.py)
            logger.exception("scheduling request %s failed; it ends with the error",
                             culprit.request_id)
            roll_back(step, built, self.running, self.waiting, self.kv, self.table.by_serial)
            self.admission.reset_images()  # its encoder plans are undone with the step
            if self.table.is_live(culprit):
                self._end_between_steps(culprit, RequestStatus.FINISHED_ERROR, "error",
                                        engine_failed_message(f"{type(e).__name__}: {e}"),
                                        ErrorCode.ENGINE_FAILED)
            return SchedulerOutput()

    def _schedule_isolated(self, step: StepPlan) -> bool:
        """True when this step belongs to a suspect alone (it may then run nothing at all)."""
        req = self.suspects.isolated
        if req is None:
            head = self.suspects.next_alone()
            if head is None or not self.admission.admit_head(head, step):
                return False
            self.suspects.isolated = head
            return True
        step.current = req
        n = min(req.num_tokens_with_pending - req.num_computed_tokens, step.budget)
        n, images = self.admission.fit_images(req, n)
        if n > 0 and not self._waits_for_step(req):
            allocated, _ = self._allocate_running(req, n, step)
            if allocated:
                self.admission.add(step, req, n, images)
        step.current = None
        return True

    def _schedule_running(self, step: StepPlan) -> None:
        """Running requests, oldest first, each its next tokens; preempts from the back when
        blocks run out."""
        i = 0
        while (i < len(self.running) and step.budget > 0
               and len(step.scheduled) < step.max_requests):
            req = step.current = self.running[i]
            n = min(req.num_tokens_with_pending - req.num_computed_tokens, step.budget)
            n, images = self.admission.fit_images(req, n)
            if n <= 0 or self._waits_for_step(req):
                i += 1  # it runs again when its token in flight lands (or ends then)
                continue
            if n == 1 and self.drafts.k:
                # Drafts only where their blocks are free: they never preempt anyone.
                d = self.drafts.num_drafts(req, step.budget - 1, step.allow_drafts,
                                           len(self.running))
                if d and self.kv.allocate_slots(req, 1 + d) is not None:
                    n += d
                elif d:
                    self.drafts.not_verified(req)
            allocated, unscheduled = self._allocate_running(req, n, step)
            i -= unscheduled
            if allocated:
                self.admission.add(step, req, n, images)
                i += 1
        step.current = None

    def _allocate_running(self, req: Request, n: int, step: StepPlan) -> tuple[bool, int]:
        """Blocks for n more tokens of a running request, preempting victims until they fit
        or the request itself is preempted. Returns whether it got them and how many requests
        scheduled earlier in this step were un-scheduled as victims."""
        unscheduled = 0
        while self.kv.allocate_slots(req, n) is None:
            victim = self._pick_victim()
            if victim.request_id in step.scheduled:  # un-schedule an earlier one
                step.budget += step.scheduled.pop(victim.request_id)[1]
                unscheduled += 1
            self._preempt(victim)
            step.preempted = True
            if victim is req:
                return False, unscheduled
        return True, unscheduled

    def _build_output(self, step: StepPlan, built: dict[int, ScheduledRequest]
                      ) -> SchedulerOutput:
        """built: the items made so far, by serial (what a failure must undo)."""
        out = SchedulerOutput(new_requests=step.new_requests)
        self.admission.fill_output(out)  # images' encoder work, the KV connector's plan
        if self.offload is not None:
            out.kv_transfers = self.offload.take_plan(have_work=bool(step.scheduled))
        if step.scheduled:  # the runner runs only steps with work
            out.kv_zero = self.failed_blocks.take_zero()
        decodes, prefills = [], []
        for req, n in step.scheduled.values():
            step.current = req
            item = built[req.serial] = self._scheduled_item(req, n)
            # a verify (k+1 tokens) goes with the chunks
            (decodes if n == 1 and item.sample else prefills).append(item)
        step.current = None
        out.scheduled = decodes + prefills
        out.num_decodes = len(decodes)
        return out

    def _scheduled_item(self, req: Request, n: int) -> ScheduledRequest:
        """The runner's view of n scheduled tokens of a request; counts them as computed."""
        start = req.num_computed_tokens
        ids = req.all_token_ids[start:start + n]
        num_drafts = start + n - req.num_tokens_with_pending  # > 0: a verify step
        if num_drafts > 0:
            ids.extend(req.spec_token_ids[:num_drafts])
        elif len(ids) < n:  # the token a step in flight samples: the runner has it on device
            ids.extend([PENDING_TOKEN] * (n - len(ids)))
        req.spec_token_ids = []  # used now, or stale once this step has run
        if n - max(num_drafts, 0) != 1:  # not a decode step: DraftBudget gave it no limits
            req.spec_draft_limits = ()
        item = ScheduledRequest(
            req.request_id, req.serial, ids, start, self.kv.block_ids(req.request_id),
            start + n >= req.num_tokens_with_pending,
            req.num_output_tokens + req.num_pending_tokens, max(num_drafts, 0),
            drafts_paused=drafts_paused(req, num_drafts, self.pipelined),
            draft_limits=req.spec_draft_limits)
        if self._groups:
            item.group_block_ids = self.kv.group_block_ids(req.request_id)
            if self._states:
                item.replay, req.state_replay = req.state_replay, 0
        # The step is as good as run: the next schedule (possibly before its results are
        # read, with async scheduling) starts after it.
        req.num_computed_tokens = start + n
        if req.mm_features and self.encoders is not None:
            self.encoders.release_done(req)
        if start < req.num_prompt_tokens:
            self._step_prompt_tokens += min(n, req.num_prompt_tokens - start)
        if item.sample:
            req.num_pending_tokens += 1
        return item

    def _micro_batch_size(self) -> int:
        """With micro-batches, the requests one step may take: an even share of those that can
        run at once (one full step would leave the next micro-batch empty, the stages idle)."""
        if self.micro_batches == 1:
            return sys.maxsize
        live = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
        return max(1, -(-live // self.micro_batches))

    def _waits_for_step(self, req: Request) -> bool:
        """Nothing to run for the request now: its token in flight is its last one (length
        limit), or with micro-batches any token of it is in flight (the step's input is not
        known yet). Prompt chunks that sample nothing may run in consecutive micro-batches:
        every stage runs the steps in order, so a chunk's KV is written before the next
        chunk reads it."""
        if req.num_pending_tokens <= 0:
            return False
        return self.micro_batches > 1 or (
            req.num_output_tokens + req.num_pending_tokens >= req.max_tokens
            or req.num_tokens_with_pending >= self.config.max_model_len)

    def wants_drafts(self, proposals_known: bool) -> bool:
        """See DraftBudget.wants_drafts."""
        return self.drafts.wants_drafts(self.running, proposals_known)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.failed_blocks.release(req, failed=False)
        self.suspects.left(req)
        self.admission.release_images(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.state_replay = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(req)

    def fail_steps(self, scheds: list[SchedulerOutput], error: str
                   ) -> tuple[list[EngineCoreOutput], set[int]]:
        """Steps that raised and will never be updated. Their requests go back to wait as
        suspects (suspects.py), or fail when they were alone. Returns the error outputs and
        the serials whose runner state must go."""
        self.suspects.num_failed_steps += 1
        plan_ids = [s.kv_transfers.plan_id for s in scheds if s.kv_transfers is not None]
        if self.offload is not None and plan_ids:
            self.offload.transfers_failed(plan_ids)
        serials: set[int] = set()
        for s in scheds:
            for it in s.scheduled:
                serials.add(it.serial)
                if it.sample:
                    req = self.table.by_serial.get(it.serial)
                    if req is not None:
                        req.num_pending_tokens -= 1
                    self.failed_blocks.settle(it.serial, failed=True)
        outputs: list[EngineCoreOutput] = []
        for serial in sorted(serials):
            req = self.table.by_serial.get(serial)
            if req is None:
                continue
            req.num_faults += 1
            if len(serials) > 1:
                self.suspects.requeue(req)
                continue
            self._end(req, RequestStatus.FINISHED_ERROR)
            outputs.append(error_output(req, engine_failed_message(error),
                                        ErrorCode.ENGINE_FAILED))
        return outputs, serials

    # ---- counters ----------------------------------------------------------------------------
    def reset_counters(self) -> None:
        """Zeroes the cumulative statistics (after start-up warm requests)."""
        self.kv.prefix_queries = self.kv.prefix_hits = 0
        self.num_preemptions = 0
        self._step_prompt_tokens = self._step_generation_tokens = 0

    def stats(self) -> SchedulerStats:
        s = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self._step_prompt_tokens,
            num_generation_tokens=self._step_generation_tokens,
            **self.drafts.take_stats(),
        )
        add_feature_stats(s, self.config.max_loras, self.running, list(self.waiting), self.kv,
                          self.encoders)
        self._step_prompt_tokens = self._step_generation_tokens = 0
        return s
