"""Continuous batching with one token budget per step.

There are no prefill and decode phases: every step, running requests get their next tokens
(one for a decode, a chunk for an unfinished prefill), then waiting requests are admitted
while budget, sequence slots and KV blocks last. When blocks run out, the lowest-priority
running request is preempted: its blocks are freed and it is recomputed later from its
prompt plus the tokens it already produced, so its output does not change.

Pipeline parallelism keeps several steps in flight (micro-batches, see engine/step_queue.py):
then a request is never in two steps at once (its next input is the token its step in flight
samples), and each step takes about an even share of the requests, so the steps in flight
keep every stage busy."""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass, field

from shoal.config import CacheConfig, SchedulerConfig
from shoal.core.errors import ErrorCode
from shoal.core.request import Request, RequestStatus
from shoal.core.scheduler_output import (
    PENDING_TOKEN,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from shoal.core.types import EngineCoreOutput, SchedulerStats
from shoal.engine.scheduler_faults import FaultHandling
from shoal.engine.scheduler_spec import SpecDecodeScheduling
from shoal.engine.waiting_queue import WaitingQueue
from shoal.kv_cache.block_pool import KVBlock
from shoal.kv_cache.manager import KVCacheManager
from shoal.kv_offload.connector import KVOffloadConnector, Staged
from shoal.kv_offload.store import TieredKVStore


@dataclass
class _Step:
    """The step being scheduled: what runs, the budget left, and what happened."""

    budget: int
    allow_drafts: bool = True  # False while a step is in flight (async scheduling)
    max_requests: int = sys.maxsize  # micro-batches: this step's share of the requests
    scheduled: dict[str, tuple[Request, int]] = field(default_factory=dict)  # id -> tokens
    new_requests: list[NewRequestData] = field(default_factory=list)
    preempted: bool = False

    def add(self, req: Request, n: int) -> None:
        self.scheduled[req.request_id] = (req, n)
        self.budget -= n


@dataclass
class _Cached:
    """A waiting request's prefix hits: device blocks, then tier blocks staged in the CPU
    tier (to load into fresh device blocks)."""

    device_hits: list[KVBlock] = field(default_factory=list)
    num_hit_tokens: int = 0  # tokens of the device hits
    staged: Staged = field(default_factory=list)


class Scheduler(FaultHandling, SpecDecodeScheduling):
    def __init__(self, sched_config: SchedulerConfig, cache_config: CacheConfig,
                 num_blocks: int, kv_store: TieredKVStore | None = None,
                 request_timeout: float | None = None, num_speculative_tokens: int = 0,
                 spec_adaptive: bool = True, spec_disable_by_batch_size: int | None = None,
                 micro_batches: int = 1):
        """num_blocks: the device KV pool, as the model runner sized it at start-up.
        request_timeout: seconds from arrival after which a request is ended with an error.
        num_speculative_tokens: drafts per step of a speculating request (0: none);
        spec_adaptive / spec_disable_by_batch_size: see scheduler_spec.py.
        micro_batches: steps in flight at once (pipeline parallelism); above 1 a request
        waits while a step samples for it, and each step takes 1/micro_batches of them."""
        self.config = sched_config
        self.micro_batches = micro_batches
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size,
                                 cache_config.enable_prefix_caching)
        # KV offloading: evicted device blocks go to the tiers, admissions load tier hits.
        self.offload = (KVOffloadConnector(kv_store, self.kv.pool, self.block_size)
                        if kv_store is not None else None)
        self.requests: dict[str, Request] = {}
        # Live requests by serial: results are matched on it (a caller may reuse an id while
        # a step holding the old request is in flight).
        self._by_serial: dict[int, Request] = {}
        self._serials = itertools.count(1)
        self.waiting = WaitingQueue(sched_config.policy)
        self.running: list[Request] = []
        self._finished_serials: set[int] = set()  # to tell the runner to drop state
        self._pending_outputs: list[EngineCoreOutput] = []  # aborts etc. not tied to a step
        self.num_preemptions = 0
        self._step_prompt_tokens = 0
        self._step_generation_tokens = 0
        self._init_faults()
        self._init_spec(num_speculative_tokens, spec_adaptive, spec_disable_by_batch_size)
        self.request_timeout = request_timeout
        self._next_expiry_check = 0.0

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.serial = next(self._serials)
        self.requests[req.request_id] = req
        self._by_serial[req.serial] = req
        self.waiting.push(req)
        if self._pending_outputs:  # the end of an earlier request under this id is old news
            self._pending_outputs = [o for o in self._pending_outputs
                                     if o.request_id != req.request_id]

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            self._end(req, RequestStatus.FINISHED_ABORTED)
            self._pending_outputs.append(EngineCoreOutput(
                request_id=rid, new_token_ids=[], finish_reason="abort",
                num_cached_tokens=max(req.num_cached_tokens, 0)))

    def request_by_serial(self, serial: int) -> Request | None:
        return self._by_serial.get(serial)

    def fail_request(self, req: Request, error: str) -> None:
        """Ends a live request that has not run with an error the client caused (its grammar
        does not compile): the frontends answer it as a bad request."""
        if self._by_serial.get(req.serial) is not req:
            return  # ended meanwhile
        self._end(req, RequestStatus.FINISHED_ERROR)
        self._pending_outputs.append(EngineCoreOutput(
            request_id=req.request_id, new_token_ids=[], finish_reason="error",
            error=error, error_code=ErrorCode.BAD_REQUEST))

    def _expire_requests(self) -> None:
        """Ends requests older than request_timeout (checked a few times a second at most)."""
        now = time.monotonic()
        if now < self._next_expiry_check or self.request_timeout is None:
            return
        self._next_expiry_check = now + min(0.05, self.request_timeout / 10)
        limit = self.request_timeout
        for req in [r for r in self.requests.values() if now - r.arrival_time > limit]:
            self._end(req, RequestStatus.FINISHED_ABORTED)
            self._pending_outputs.append(EngineCoreOutput(
                request_id=req.request_id, new_token_ids=[], finish_reason="error",
                num_cached_tokens=max(req.num_cached_tokens, 0),
                error=f"the request timed out: it took longer than request_timeout "
                      f"({limit:g} s)", error_code=ErrorCode.TIMED_OUT))

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        if self.offload is not None:  # reads or pins it may hold while deferred
            self.offload.abandon(req.request_id)
        self._release_blocks(req, failed=status == RequestStatus.FINISHED_ERROR)
        self.requests.pop(req.request_id, None)
        self._by_serial.pop(req.serial, None)
        self._finished_serials.add(req.serial)
        self._left(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs)

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
        if self.request_timeout is not None:
            self._expire_requests()
        step = _Step(budget=self.config.max_num_batched_tokens, allow_drafts=allow_drafts,
                     max_requests=self._micro_batch_size())
        if not self._schedule_isolated(step):  # a suspect of a failed step runs alone
            self._schedule_running(step)
            if not step.preempted:
                self._schedule_waiting(step)
        return self._build_output(step)

    def _schedule_running(self, step: _Step) -> None:
        """Running requests, oldest first, each its next tokens; preempts from the back when
        blocks run out."""
        i = 0
        while (i < len(self.running) and step.budget > 0
               and len(step.scheduled) < step.max_requests):
            req = self.running[i]
            n = min(req.num_tokens_with_pending - req.num_computed_tokens, step.budget)
            if n <= 0 or self._waits_for_step(req):
                i += 1  # it runs again when its token in flight lands (or ends then)
                continue
            if n == 1 and self.num_speculative_tokens:
                # Drafts only where their blocks are free: they never preempt anyone.
                d = self._num_drafts(req, step.budget - 1, step.allow_drafts)
                if d and self.kv.allocate_slots(req, 1 + d) is not None:
                    n += d
            allocated, unscheduled = self._allocate_running(req, n, step)
            i -= unscheduled
            if allocated:
                step.add(req, n)
                i += 1

    def _allocate_running(self, req: Request, n: int, step: _Step) -> tuple[bool, int]:
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

    def _schedule_waiting(self, step: _Step) -> None:
        """Waiting requests in queue order, while there is budget, a free sequence slot and
        blocks. One whose KV is still on its way from a tier is passed over this step."""
        deferred: list[Request] = []  # ask again next step, in the same order
        while (len(self.waiting) and step.budget > 0
               and len(self.running) < self.config.max_num_seqs
               and len(step.scheduled) < step.max_requests):
            req = self.waiting.peek()
            if req.num_pending_tokens or req.suspect:
                # preempted while a step was in flight: its token is not known yet; or a
                # suspect of a failed step, which is only admitted alone
                break
            if req.structured is not None and not req.structured.is_ready():
                deferred.append(self.waiting.pop())  # its grammar is still compiling
                continue
            cached = self._find_cached(req)
            if cached is None:
                deferred.append(self.waiting.pop())
                continue
            if not self._admit(req, cached, step):
                break
        for req in reversed(deferred):
            self.waiting.push_front(req)

    def _find_cached(self, req: Request) -> _Cached | None:
        """The request's prefix hits: device blocks, then tier blocks pinned in the CPU tier
        (KV offloading); None while some tier blocks are still being read."""
        if req.sampling_params.prompt_logprobs is not None:
            return _Cached()  # every prompt position's logits are needed: compute them all
        # A request asking again after a deferral had its query counted the first time.
        count = self.offload is None or not self.offload.is_deferred(req.request_id)
        hits, n_hit = self.kv.get_computed_blocks(req, count=count)
        staged: Staged = []
        if self.offload is not None:
            found = self.offload.stage(req, len(hits))
            if found is None:
                return None
            staged = found
        return _Cached(hits, n_hit, staged)

    def _admit(self, req: Request, cached: _Cached, step: _Step) -> bool:
        """Allocates the waiting request's blocks and makes it running; False (nothing
        changed) when they do not fit."""
        n_loaded = len(cached.staged) * self.block_size  # tier hits: loaded, not computed
        n = req.num_tokens - cached.num_hit_tokens - n_loaded
        if n > step.budget and not self.config.enable_chunked_prefill:
            new_blocks = None  # the whole prompt must fit in one step
        else:
            n = min(n, step.budget)
            new_blocks = self.kv.allocate_slots(req, n_loaded + n, cached.device_hits)
        if new_blocks is None:
            if cached.staged:
                self.offload.cancel(cached.staged)
            return False
        if cached.staged:
            self.offload.commit(cached.staged, new_blocks)
        n_hit = cached.num_hit_tokens + n_loaded
        req.num_computed_tokens = n_hit
        self.waiting.pop()
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = n_hit
            req.first_scheduled_time = time.monotonic()
        if req.status == RequestStatus.WAITING:
            step.new_requests.append(NewRequestData(
                req.request_id, req.serial, req.prompt_token_ids, req.sampling_params,
                req.eos_token_ids, list(req.output_token_ids)))
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        step.add(req, n)
        return True

    def _build_output(self, step: _Step) -> SchedulerOutput:
        out = SchedulerOutput(new_requests=step.new_requests)
        if self.offload is not None:
            out.kv_transfers = self.offload.take_plan(have_work=bool(step.scheduled))
        if step.scheduled:  # the runner runs only steps with work
            self._take_zero(out)
        decodes, prefills = [], []
        for req, n in step.scheduled.values():
            item = self._scheduled_item(req, n)  # a verify (k+1 tokens) goes with the chunks
            (decodes if n == 1 and item.sample else prefills).append(item)
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
        item = ScheduledRequest(
            request_id=req.request_id,
            serial=req.serial,
            input_token_ids=ids,
            context_len=start,
            block_ids=self.kv.block_ids(req.request_id),
            sample=start + n >= req.num_tokens_with_pending,
            num_output_tokens=req.num_output_tokens + req.num_pending_tokens,
            num_draft_tokens=max(num_drafts, 0),
        )
        # The step is as good as run: the next schedule (possibly before its results are
        # read, with async scheduling) starts after it.
        req.num_computed_tokens = start + n
        if start < req.num_prompt_tokens:
            self._step_prompt_tokens += min(n, req.num_prompt_tokens - start)
        if item.sample:
            req.num_pending_tokens += 1
        return item

    def _micro_batch_size(self) -> int:
        """With micro-batches, the requests one step may take: an even share of those that
        can run at once. One full step would leave the next micro-batch empty (all its
        requests in flight) and the stages idle in turn."""
        if self.micro_batches == 1:
            return sys.maxsize
        live = min(len(self.running) + len(self.waiting), self.config.max_num_seqs)
        return max(1, -(-live // self.micro_batches))

    def _waits_for_step(self, req: Request) -> bool:
        """Nothing to run for the request now: its token in flight is its last one, or with
        micro-batches any token of it is in flight (the step's input is not known yet).
        Prompt chunks that sample nothing may run in consecutive micro-batches: every stage
        runs the steps in order, so a chunk's KV is written before the next chunk reads it."""
        if self.micro_batches > 1 and req.num_pending_tokens > 0:
            return True
        return self._ends_with_pending(req)

    def _ends_with_pending(self, req: Request) -> bool:
        """The token in flight is the request's last one (length limit): nothing to run."""
        return req.num_pending_tokens > 0 and (
            req.num_output_tokens + req.num_pending_tokens >= req.max_tokens
            or req.num_tokens_with_pending >= self.config.max_model_len)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release_blocks(req, failed=False)
        self._left(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(req)

    # ---- results -------------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Applies a step's results. With async scheduling the next step may already be
        scheduled: a request may meanwhile have been preempted (its token still counts) or
        have ended (its results are dropped). Results are matched on serials, so a request
        that took the id of one that ended meanwhile gets nothing of it. KV copies the runner
        reports done release their CPU slots, whatever became of the requests they were
        for."""
        if self.offload is not None and result.kv_transfers_done:
            self.offload.transfers_done(result.kv_transfers_done)
        outputs = self._pending_outputs
        self._pending_outputs = []
        for item in sched.scheduled:
            failed = item.serial in result.failed_serials
            if item.sample and self._released:
                self._settle_released(item.serial, failed)
            req = self._by_serial.get(item.serial)
            if req is None:
                continue  # ended while the step ran
            if item.sample:
                req.num_pending_tokens -= 1
            if failed:
                self._end(req, RequestStatus.FINISHED_ERROR)
                outputs.append(EngineCoreOutput(
                    request_id=req.request_id, new_token_ids=[], finish_reason="error",
                    error="the model produced non-finite logits",
                    error_code=ErrorCode.NON_FINITE))
                continue
            prompt_lp = result.prompt_logprobs.get(req.serial)
            if not item.sample:
                if prompt_lp:
                    outputs.append(EngineCoreOutput(req.request_id, [], prompt_logprobs=prompt_lp,
                                                    num_cached_tokens=req.num_cached_tokens))
                continue
            outputs.append(self._apply_tokens(req, item, result, prompt_lp))
        return outputs

    def _apply_tokens(self, req: Request, item: ScheduledRequest, result: ModelRunnerOutput,
                      prompt_lp: list | None) -> EngineCoreOutput:
        """The step's token for the request, or with speculative decoding its accepted
        drafts and one more, up to the first that ends it."""
        serial = req.serial
        tokens = result.verified_token_ids.get(serial)
        if tokens is None:
            tokens = [result.sampled_token_ids[serial]]
            lp = result.logprobs.get(serial)
            lps = [lp] if lp is not None else None
        else:
            lps = result.verified_logprobs.get(serial)
        if item.num_draft_tokens:
            self._settle_verified(req, item, tokens)
        status = None
        for n, token in enumerate(tokens, 1):
            req.append_output_token(token)
            status = self._check_grammar(req, token) or self._check_stop(req, token)
            if status is not None:
                tokens = tokens[:n]
                break
        self._step_generation_tokens += len(tokens)
        if req.suspect:
            self._sampled_fine(req)
        drafts = result.draft_token_ids.get(serial)
        # A constrained request's drafts are checked by its grammar at verify time (each
        # position masked as if the drafts before it were accepted).
        if drafts and status is None and req.status == RequestStatus.RUNNING:
            req.spec_token_ids = drafts
        out = EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            new_logprobs=lps[:len(tokens)] if lps else None,
            prompt_logprobs=prompt_lp,
            num_cached_tokens=req.num_cached_tokens,
        )
        if req.num_output_tokens == 1 and req.first_scheduled_time is not None:
            out.queue_time = max(0.0, req.first_scheduled_time - req.arrival_time)
        if status == RequestStatus.FINISHED_ERROR:
            out.finish_reason = "error"
            out.error = "the sampled token does not fit the request's grammar"
            out.error_code = ErrorCode.OUTSIDE_GRAMMAR
            self._end(req, status)
        elif status is not None:
            out.finish_reason = "stop" if status == RequestStatus.FINISHED_STOPPED else "length"
            out.stop_reason = req.stop_reason
            self._end(req, status)
        return out

    @staticmethod
    def _check_grammar(req: Request, token: int) -> RequestStatus | None:
        """Advances a structured request's grammar: it stops once the grammar is complete
        (its stop token accepted, which ignore_eos cannot skip)."""
        if req.structured is None:
            return None
        if not req.structured.accept(token):
            # The bitmask only allows what the grammar accepts; a token outside it means the
            # row had nothing allowed (e.g. min_tokens banned the only stop token).
            return RequestStatus.FINISHED_ERROR
        if req.structured.ended:  # accept() asked the matcher once
            return RequestStatus.FINISHED_STOPPED
        return None

    def _end(self, req: Request, status: RequestStatus) -> None:
        """Finishes a running request, or one preempted while its last step was in flight."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._finish(req, status)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        n_out = req.num_output_tokens
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and token in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token in sp.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if n_out >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def reset_counters(self) -> None:
        """Zeroes the cumulative statistics (after start-up warm requests)."""
        self.kv.prefix_queries = self.kv.prefix_hits = 0
        self.num_preemptions = 0
        self._step_prompt_tokens = self._step_generation_tokens = 0

    def take_finished_serials(self) -> set[int]:
        """Serials of the requests that ended since the last call (the runner drops them)."""
        ids, self._finished_serials = self._finished_serials, set()
        return ids

    def take_pending_outputs(self) -> list[EngineCoreOutput]:
        out, self._pending_outputs = self._pending_outputs, []
        return out

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
            **self._take_spec_stats(),
        )
        self._step_prompt_tokens = self._step_generation_tokens = 0
        return s
