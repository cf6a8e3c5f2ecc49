"""The scheduler of a pooling engine: the same request table, waiting queue, token budget,
sequence limit, priorities, aborts and timeouts as generation, with prefill-only requests.

A pooling request is admitted whole (never chunked: pooling needs every token's state in one
forward), takes no KV blocks (the pooling runner keeps no cache) and finishes with its one
step, carrying its pooled result. A prompt that does not fit this step's remaining budget
waits for the next step; start-up guarantees max_model_len <= max_num_batched_tokens, so
every valid prompt fits an empty step. The requests of a step that raised run again one per
step; one that raises alone fails."""

from __future__ import annotations

import time

from shoal.config import SchedulerConfig
from shoal.core.errors import ErrorCode
from shoal.core.request import Request, RequestStatus
from shoal.core.scheduler_output import (
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from shoal.core.types import EngineCoreOutput, SchedulerStats
from shoal.engine.request_table import (
    RequestTable,
    RequestTableFront,
    engine_failed_message,
    error_output,
)
from shoal.engine.waiting_queue import WaitingQueue


class PoolingScheduler(RequestTableFront):
    def __init__(self, sched_config: SchedulerConfig, request_timeout: float | None = None):
        if sched_config.max_model_len > sched_config.max_num_batched_tokens:
            raise ValueError(
                f"a pooling model runs whole prompts in one step: max_num_batched_tokens "
                f"({sched_config.max_num_batched_tokens}) must be >= max_model_len "
                f"({sched_config.max_model_len})")
        self.config = sched_config
        self.table = RequestTable(request_timeout)
        self.waiting = WaitingQueue(sched_config.policy)
        self.running: list[Request] = []
        self._prompt_tokens = 0

    def add_request(self, req: Request) -> None:
        self.table.add(req)
        self.waiting.push(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self.table.by_id.get(rid)
            if req is not None:
                self._end(req, RequestStatus.FINISHED_ABORTED)
                self.table.emit(EngineCoreOutput(rid, [], finish_reason="abort"))

    def _end(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self.table.remove(req)

    def schedule(self, allow_drafts: bool = True) -> SchedulerOutput:
        """Whole prompts in queue order while budget and sequence slots last; a suspect of a
        failed step runs alone."""
        for req in self.table.expired():
            self._end(req, RequestStatus.FINISHED_ABORTED)
            self.table.emit(error_output(req, self.table.timeout_message(),
                                         ErrorCode.TIMED_OUT))
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        while len(self.waiting) and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            if req.num_tokens > budget or (req.suspect and out.scheduled):
                break
            self._admit(self.waiting.pop(), out)
            budget -= req.num_tokens
            if req.suspect:
                break
        return out

    def _admit(self, req: Request, out: SchedulerOutput) -> None:
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = 0
            req.first_scheduled_time = time.monotonic()
        # Always sent: after a failed step the runner has forgotten the request.
        out.new_requests.append(NewRequestData(
            req.request_id, req.serial, req.prompt_token_ids, req.sampling_params,
            req.eos_token_ids, pooling_params=req.pooling_params,
            token_type_ids=req.token_type_ids))
        out.scheduled.append(ScheduledRequest(
            request_id=req.request_id, serial=req.serial,
            input_token_ids=list(req.prompt_token_ids), context_len=0, block_ids=[],
            sample=True, num_output_tokens=0))
        req.status = RequestStatus.RUNNING
        req.num_pending_tokens = 1
        self.running.append(req)
        self._prompt_tokens += req.num_tokens

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Every scheduled request ends here: with its pooled result, or with an error when
        the model produced non-finite values for it."""
        outputs = self.table.take_pending_outputs()
        for item in sched.scheduled:
            req = self.table.by_serial.get(item.serial)
            if req is None:
                continue  # aborted while the step ran
            req.num_pending_tokens = 0
            pooled = result.pooled.get(item.serial)
            if pooled is None:
                self._end(req, RequestStatus.FINISHED_ERROR)
                outputs.append(error_output(req, "the model produced non-finite values",
                                            ErrorCode.NON_FINITE))
                continue
            queue_time = (max(0.0, req.first_scheduled_time - req.arrival_time)
                          if req.first_scheduled_time is not None else None)
            self._end(req, RequestStatus.FINISHED_STOPPED)
            outputs.append(EngineCoreOutput(
                request_id=req.request_id, new_token_ids=[], finish_reason="stop",
                pooled=pooled.tobytes(), pooled_shape=list(pooled.shape),
                queue_time=queue_time))
        return outputs

    def fail_steps(self, scheds: list[SchedulerOutput], error: str
                   ) -> tuple[list[EngineCoreOutput], set[int]]:
        """Steps that raised: a request alone in them fails, the others wait again, each to
        run alone. Returns the error outputs and the serials whose runner state must go."""
        serials = {it.serial for s in scheds for it in s.scheduled}
        outputs: list[EngineCoreOutput] = []
        for serial in sorted(serials):
            req = self.table.by_serial.get(serial)
            if req is None:
                continue
            req.num_faults += 1
            if len(serials) == 1 or req.suspect:
                self._end(req, RequestStatus.FINISHED_ERROR)
                outputs.append(error_output(req, engine_failed_message(error),
                                            ErrorCode.ENGINE_FAILED))
            elif req.status == RequestStatus.RUNNING:
                self.running.remove(req)
                req.status, req.suspect, req.num_pending_tokens = (
                    RequestStatus.WAITING, True, 0)
                self.waiting.push_front(req)
        return outputs, serials

    def fail_request(self, req: Request, error: str) -> None:
        raise AssertionError("pooling requests have no grammar to fail")

    def wants_drafts(self, proposals_known: bool) -> bool:
        return False

    def reset_counters(self) -> None:
        self._prompt_tokens = 0

    def stats(self) -> SchedulerStats:
        s = SchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                           num_prompt_tokens=self._prompt_tokens)
        self._prompt_tokens = 0
        return s
