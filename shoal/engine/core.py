"""EngineCore: the scheduler and the model runner in one busy loop, token ids only.

`step()` is the whole engine: schedule, run, update. The offline LLM calls it in-process;
the server runs it in its own process behind a ZMQ socket (engine/core_proc.py).

With async scheduling one step stays in flight: `step()` schedules and launches step N+1,
then waits for step N's tokens and applies them, so the host's scheduling, bookkeeping and
output handling run while the GPU computes. Step N+1 takes the tokens of step N from the
device (they are not known on the host yet); a request that stops at step N has computed one
token too many in step N+1, which is dropped. Requests whose sampling reads all tokens so far
(penalties, min_tokens) switch the loop back to one step at a time while they run. With
speculative decoding, steps that verify drafts run one at a time (their drafts come from the
results of the step before, and their accepted count decides the next inputs) and steps
without drafts are pipelined: speculation that does not pay (the adaptive budget and the
backoff turned it off) costs no more than plain decoding."""

from __future__ import annotations

import atexit
import gc
import logging
import time
import weakref
from typing import Any

from shoal.config import EngineConfig
from shoal.core.request import Request
from shoal.core.scheduler_output import GrammarBitmask, SchedulerOutput
from shoal.core.types import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from shoal.engine.batch_queue import BatchQueue, MicroBatching
from shoal.engine.dp_lockstep import join_dp_lockstep
from shoal.engine.input_processor import EngineLimits, RequestLimits, validate_core_request
from shoal.engine.pooling_scheduler import PoolingScheduler
from shoal.engine.scheduler import Scheduler
from shoal.executor import build_model_executor
from shoal.kv_offload.factory import build_kv_offload
from shoal.loader import LoadedModel
from shoal.structured_output.manager import StructuredOutputManager
from shoal.worker.model_runner import StepFuture
from shoal.worker.pooling_runner import PoolingModelRunner

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> None:
    """Moves everything built so far (torch, the model, tokenizer tables: millions of
    objects) out of the garbage collector's reach. Otherwise the first full collection comes
    during real traffic, as the first batch's requests add up: a 292 ms step in the middle of
    W8's first run on the H200, none in the second."""
    gc.collect()
    if not gc.get_freeze_count():
        # Frozen objects are never freed at exit; nanobind (triton) then reports leaks.
        atexit.register(gc.unfreeze)
    gc.freeze()


class EngineCore(MicroBatching):
    def __init__(self, config: EngineConfig, loaded: LoadedModel,
                 request_limits: RequestLimits | None = None):
        """request_limits: what one request may ask for (RequestLimits.from_engine_args);
        the frontends read them from `limits`."""
        t0 = time.perf_counter()
        request_limits = request_limits or RequestLimits()
        self.config = config
        self.pooling = config.model_config.runner == "pooling"
        self.kv_offload = self.kv_transfer = None
        # DP+EP: the replicas' process group and per-step agreement (engine/dp_lockstep.py),
        # joined before the model is built; None otherwise.
        self.dp_lockstep = join_dp_lockstep(config)
        if self.pooling:  # prefill-only requests, no KV cache (see pooling_scheduler.py)
            self.runner: Any = PoolingModelRunner(config, loaded)
            num_blocks = 0
            self.scheduler: Scheduler = PoolingScheduler(
                config.scheduler_config, config.cache_config,
                request_timeout=request_limits.request_timeout)
        else:
            num_blocks = self._start_generation(loaded, request_limits)
        self.vocab_size = self.runner.vocab_size
        spec = config.speculative_config
        # Pooling requests take one step each. With speculative decoding the loop pipelines
        # the steps that verify no drafts (see _can_pipeline).
        self.async_scheduling = config.async_scheduling and not self.pooling
        self._speculating = spec is not None
        # ngram drafts only where the context repeats itself: a request without drafts from
        # its last results wants none (the others always propose k).
        self._proposals_known = spec is not None and spec.method == "ngram"
        self._inflight: tuple[SchedulerOutput, StepFuture] | None = None
        # Scheduled steps whose results the scheduler has not applied yet: what a step that
        # raises leaves behind (see scheduler_faults.py).
        self._unsettled: list[SchedulerOutput] = []
        self._history_requests: set[int] = set()  # serials: sampling needs every earlier token
        # Structured outputs: grammars compile in the manager's pool; requests whose grammar
        # is still compiling (to fail them if it does not), and the live structured serials.
        self.structured = StructuredOutputManager(
            config.structured_outputs_backend, loaded.tokenizer, self.runner.vocab_size,
            self._eos_ids(loaded), pin_memory=config.device.type == "cuda")
        self._compiling: dict[int, Request] = {}
        self._structured_serials: set[int] = set()
        self.eos_token_ids = frozenset(self._eos_ids(loaded))
        sc = config.scheduler_config
        # What every frontend validates requests against (sent in the ready message).
        self.limits = EngineLimits(
            vocab_size=self.vocab_size, max_model_len=sc.max_model_len,
            num_kv_blocks=num_blocks, block_size=config.cache_config.block_size,
            max_num_seqs=sc.max_num_seqs, eos_token_ids=self.eos_token_ids,
            request=request_limits,
            pooling=self.runner.info if isinstance(self.runner, PoolingModelRunner) else None)
        if config.device.type == "cuda" and not self.pooling:
            t1 = time.perf_counter()
            self._warm_request_path()
            self.runner.startup_times["warm_requests"] = time.perf_counter() - t1
        freeze_startup_heap()
        logger.info("engine core ready in %.2f s (max_num_batched_tokens %d, max_num_seqs %d)",
                    time.perf_counter() - t0, sc.max_num_batched_tokens, sc.max_num_seqs)

    def _start_generation(self, loaded: LoadedModel, request_limits: RequestLimits) -> int:
        """The generation runner, its KV pool, the KV tiers and the scheduler; returns the
        number of device KV blocks."""
        config = self.config
        self.runner = build_model_executor(config, loaded)  # a ModelRunner, or N ranks of one
        num_blocks = self.runner.initialize_kv_cache()
        # Secondary KV tiers (CPU, then disk...) for the scheduler and their device copies for
        # the runner; None unless kv_offloading_size is set.
        offload = build_kv_offload(config, self.runner.kv_caches, loaded)
        self.kv_offload = offload.store if offload is not None else None
        self.kv_transfer = offload.transfer if offload is not None else None
        if self.kv_transfer is not None:
            self.runner.use_kv_transfer(self.kv_transfer)
        if self.kv_offload is not None:
            # An engine dropped without shutdown() (or alive at interpreter exit) still writes
            # its CPU tier down (shutdown() does more first, and this then does nothing).
            weakref.finalize(self, self.kv_offload.shutdown)
        spec = config.speculative_config
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, num_blocks,
                                   kv_store=self.kv_offload,
                                   request_timeout=request_limits.request_timeout,
                                   num_speculative_tokens=spec.num_speculative_tokens
                                   if spec is not None else 0,
                                   spec_adaptive=spec is None or spec.adaptive_budget,
                                   spec_disable_by_batch_size=spec.disable_by_batch_size
                                   if spec is not None else None,
                                   micro_batches=config.parallel_config.pipeline_parallel_size)
        if config.parallel_config.pipeline_parallel_size > 1:  # see engine/batch_queue.py
            self.batch_queue = BatchQueue(config.parallel_config.pipeline_parallel_size)
        return num_blocks

    @staticmethod
    def _eos_ids(loaded: LoadedModel) -> list[int]:
        eos = getattr(loaded.hf_config, "eos_token_id", None)
        if loaded.tokenizer is not None and loaded.tokenizer.eos_token_id is not None:
            eos = loaded.tokenizer.eos_token_id if eos is None else eos
        return sorted([eos] if isinstance(eos, int) else (eos or []))

    def _warm_request_path(self) -> None:
        """Runs requests end to end through the scheduler, the runner and the sampler before
        the engine reports ready, so real traffic finds every kernel loaded: a greedy one, a
        sampled one with top-p/top-k and logprobs, then a full batch (max_num_seqs, as far as
        the pool allows) of sampled ones, as the first busy batch will be. Then forgets them."""
        from shoal.sampling_params import SamplingParams

        prompt = [i % self.vocab_size for i in range(1, 40)]
        params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                  SamplingParams(temperature=0.7, top_p=0.9, top_k=20, max_tokens=3,
                                 ignore_eos=True, logprobs=2, seed=0)]
        batch = min(self.limits.max_num_seqs, self.limits.num_kv_blocks // 4)
        params += [SamplingParams(temperature=0.6, max_tokens=3, ignore_eos=True)] * batch
        for i, sp in enumerate(params):
            self.add_request(EngineCoreRequest(f"__warmup_{i}", prompt[:8 + i % 31], sp,
                                               time.monotonic()))
            if i == 1:  # the two single requests first, alone
                self._run_until_idle()
        self._run_until_idle()
        self.scheduler.kv.reset_prefix_cache()
        self.scheduler.reset_counters()

    def _run_until_idle(self) -> None:
        while self.has_unfinished_requests():
            self.step()

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        max_tokens = validate_core_request(self.limits, req)
        request = Request(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            sampling_params=req.sampling_params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
            arrival_time=req.arrival_time,
            priority=req.priority,
            cache_salt=req.cache_salt,
            pooling_params=req.pooling_params,
            token_type_ids=req.token_type_ids,
        )
        if req.sampling_params.structured_outputs is not None:
            request.structured = self.structured.request(req.sampling_params.structured_outputs)
        self.scheduler.add_request(request)  # gives it its serial
        if req.sampling_params.needs_output_history:
            self._history_requests.add(request.serial)
        if request.structured is not None:
            self._structured_serials.add(request.serial)
            self._compiling[request.serial] = request  # schedulable once _check_grammars saw it

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        """Work of this engine's own, or (DP+EP) of another replica at the last round."""
        return self._has_local_work() or (self.dp_lockstep is not None
                                          and self.dp_lockstep.group_busy)

    def _has_local_work(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or self._inflight is not None
                or bool(self.batch_queue))

    def shutdown(self) -> None:
        """Between steps, before the process exits: finishes the step in flight (its KV copies
        are then done and reported to the scheduler) and writes the CPU KV tier down to the
        lower tiers, so a restart finds those blocks."""
        self._finish_inflight()
        self._drain_batch_queue()
        self.structured.shutdown()
        if self.kv_offload is not None:
            self.kv_offload.shutdown()
        stop_workers = getattr(self.runner, "shutdown", None)  # tensor-parallel ranks
        if stop_workers is not None:
            stop_workers()
        if self.dp_lockstep is not None:
            self.dp_lockstep.shutdown()

    # ---- the loop body ----------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        lockstep = self.dp_lockstep  # DP+EP: every replica steps, or none (dp_lockstep.py)
        if lockstep is not None and not lockstep.begin_step(self._has_local_work(), self.runner):
            return self._idle_round()
        try:
            outputs = (self._run_step() if self.batch_queue is None
                       else self._step_with_batch_queue())
        except Exception as e:  # one bad request or a bug: never the whole engine
            if lockstep is not None:  # ...except under DP+EP: the replicas' collectives broke
                raise
            outputs = self._recover(e)
        if lockstep is not None:
            lockstep.end_step(self.runner)  # the dummy forward of a replica with nothing run
        outputs = self.scheduler.take_pending_outputs() + outputs
        # Requests that ended (finished or aborted) release their sampling state now.
        finished = self.scheduler.take_finished_serials()
        self.runner.remove_requests(finished)
        self._history_requests -= finished
        self._structured_serials -= finished
        stats = self.scheduler.stats()
        if self.kv_offload is not None:
            stats.kv_tiers = {t.name: t.as_metrics() for t in self.kv_offload.stats().tiers}
        return EngineCoreOutputs(outputs=outputs, stats=stats)

    def _idle_round(self) -> EngineCoreOutputs:
        """DP+EP, every replica idle: no step; outputs of requests ended meanwhile (aborts),
        and no stats unless there are some (the serving loop then sends nothing)."""
        outputs = self.scheduler.take_pending_outputs()
        finished = self.scheduler.take_finished_serials()
        self.runner.remove_requests(finished)
        self._history_requests -= finished
        self._structured_serials -= finished
        return EngineCoreOutputs(outputs=outputs,
                                 stats=self.scheduler.stats() if outputs else None)

    def _run_step(self) -> list[EngineCoreOutput]:
        if self._compiling:
            self._check_grammars()
        pipelined = self._can_pipeline()
        sched = None
        if pipelined or self._inflight is None:
            sched = self.scheduler.schedule(allow_drafts=self._inflight is None)
        launched = None
        if sched is not None and not sched.is_empty:
            if self._structured_serials:
                sched.grammar_bitmask = self._grammar_bitmask(sched)
            self._unsettled.append(sched)
            launched = self.runner.launch(sched)
        elif self._compiling and self._inflight is None:  # nothing to run but grammars
            self.structured.wait_any([r.structured for r in self._compiling.values()], 0.01)
        # Step N's results, read while step N+1 (just launched) runs; drafts proposed from
        # them would come too late for step N+1, which is scheduled without any.
        outputs = self._finish_inflight(propose=launched is None)
        if launched is not None and sched.grammar_bitmask is not None and (
                sched.grammar_bitmask.deferred):
            # Its structured rows sample now that the grammars have seen step N's tokens;
            # its forward has been running meanwhile.
            self.runner.sample_deferred(launched)
        if launched is not None:
            self._inflight = (sched, launched)
            if not pipelined:
                outputs += self._finish_inflight(propose=True)
        return outputs

    def _can_pipeline(self) -> bool:
        """Whether the next step may be scheduled while the one in flight runs. Not when a
        request's sampling reads every earlier token (penalties, min_tokens; a grammar needs
        only the last, see _grammar_bitmask), not behind a verify step (its
        accepted drafts decide where the next inputs start), and not when the next step
        would verify drafts, which are proposed from the results of the step before it."""
        if not self.async_scheduling or self._history_requests:
            return False
        if self._speculating:
            if self._inflight is not None and self._inflight[0].has_drafts:
                return False
            return not self.scheduler.wants_drafts(self._proposals_known)
        return True

    def _check_grammars(self) -> None:
        """Requests whose grammar failed to compile end with a bad-request error."""
        for serial, req in list(self._compiling.items()):
            if req.structured.is_compiled():
                del self._compiling[serial]
                error = req.structured.settle()
                if error is not None:
                    self.scheduler.fail_request(req, error)

    def _grammar_bitmask(self, sched: SchedulerOutput) -> GrammarBitmask | None:
        """The structured rows that sample this step, and how to fill their bitmask on the
        host (the runner does it while the device runs the forward pass)."""
        serials, grammars = [], []
        # A verify step: rows for every position of each request (after each of its drafts).
        drafts: list[list[int]] | None = [] if sched.has_drafts else None
        for item in sched.scheduled:
            if item.sample and item.serial in self._structured_serials:
                req = self.scheduler.request_by_serial(item.serial)
                if req is not None and req.structured is not None:
                    serials.append(item.serial)
                    grammars.append(req.structured)
                    if drafts is not None:
                        k = item.num_draft_tokens
                        drafts.append(item.input_token_ids[-k:] if k else [])
        if not grammars:
            return None
        # Behind a step in flight, sampling waits until that step's tokens are applied.
        return GrammarBitmask(serials, lambda: self.structured.fill_bitmask(grammars, drafts),
                              deferred=self._inflight is not None)

    def _finish_inflight(self, propose: bool = True) -> list[EngineCoreOutput]:
        """The step in flight's results into the scheduler. propose=False: a step was
        launched after it, so drafting from it may be skipped (see ModelRunner.finish)."""
        if self._inflight is None:
            return []
        sched, fut = self._inflight
        self._inflight = None
        outputs = self.scheduler.update(sched, self.runner.finish(fut, propose=propose))
        self._unsettled = [s for s in self._unsettled if s is not sched]
        return outputs

    def _recover(self, error: Exception) -> list[EngineCoreOutput]:
        """A step raised: the requests of every step not settled yet are rerun one by one,
        and the one that raises alone fails (scheduler_faults.py); the rest keep serving."""
        logger.exception("an engine step failed; its requests are retried one at a time")
        scheds, self._unsettled = self._unsettled, []
        self._inflight = None
        if self.batch_queue is not None:
            self.batch_queue.clear()
        self.runner.reset_after_fault()
        outputs, serials = self.scheduler.fail_steps(scheds, f"{type(error).__name__}: {error}")
        self.runner.remove_requests(serials)
        return outputs
