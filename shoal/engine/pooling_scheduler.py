"""The scheduler of a pooling engine: the same queue, token budget, sequence limit, priorities,
aborts and timeouts as generation, with prefill-only requests.

A pooling request is admitted whole (never chunked: pooling needs every token's state in one
forward), takes no KV blocks (the pooling runner keeps no cache) and finishes with its one
step, carrying its pooled result. A prompt that does not fit this step's remaining budget
waits for the next step; start-up guarantees max_model_len <= max_num_batched_tokens, so
every valid prompt fits an empty step."""

from __future__ import annotations

import dataclasses
import time

from shoal.config import CacheConfig, SchedulerConfig
from shoal.core.errors import ErrorCode
from shoal.core.request import Request, RequestStatus
from shoal.core.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from shoal.core.types import EngineCoreOutput
from shoal.engine.scheduler import Scheduler, _Cached, _Step

# The base scheduler keeps a block pool; a pooling engine never allocates from it.
_NO_KV_BLOCKS = 1


class PoolingScheduler(Scheduler):
    def __init__(self, sched_config: SchedulerConfig, cache_config: CacheConfig,
                 request_timeout: float | None = None):
        if sched_config.max_model_len > sched_config.max_num_batched_tokens:
            raise ValueError(
                f"a pooling model runs whole prompts in one step: max_num_batched_tokens "
                f"({sched_config.max_num_batched_tokens}) must be >= max_model_len "
                f"({sched_config.max_model_len})")
        no_cache = dataclasses.replace(cache_config, enable_prefix_caching=False)
        super().__init__(sched_config, no_cache, _NO_KV_BLOCKS, request_timeout=request_timeout)

    def _find_cached(self, req: Request) -> _Cached | None:
        return _Cached()  # nothing is cached: every pooling request runs its whole prompt

    def _admit(self, req: Request, cached: _Cached, step: _Step) -> bool:
        n = req.num_tokens
        if n > step.budget:
            return False
        self.waiting.pop()
        req.num_computed_tokens = 0
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = 0
            req.first_scheduled_time = time.monotonic()
        # Always sent: after a failed step the runner has forgotten the request.
        step.new_requests.append(NewRequestData(
            req.request_id, req.serial, req.prompt_token_ids, req.sampling_params,
            req.eos_token_ids, pooling_params=req.pooling_params,
            token_type_ids=req.token_type_ids))
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        step.add(req, n)
        return True

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Every scheduled request ends here: with its pooled result, or with an error when
        the model produced non-finite values for it."""
        outputs = self._pending_outputs
        self._pending_outputs = []
        for item in sched.scheduled:
            req = self._by_serial.get(item.serial)
            if req is None:
                continue  # aborted while the step ran
            req.num_pending_tokens = 0
            pooled = result.pooled.get(item.serial)
            if pooled is None:
                self._end(req, RequestStatus.FINISHED_ERROR)
                outputs.append(EngineCoreOutput(
                    request_id=req.request_id, new_token_ids=[], finish_reason="error",
                    error="the model produced non-finite values",
                    error_code=ErrorCode.NON_FINITE))
                continue
            if req.suspect:
                self._sampled_fine(req)
            queue_time = (max(0.0, req.first_scheduled_time - req.arrival_time)
                          if req.first_scheduled_time is not None else None)
            self._end(req, RequestStatus.FINISHED_STOPPED)
            outputs.append(EngineCoreOutput(
                request_id=req.request_id, new_token_ids=[], finish_reason="stop",
                pooled=pooled.tobytes(), pooled_shape=list(pooled.shape),
                queue_time=queue_time))
        return outputs
