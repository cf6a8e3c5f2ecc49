"""EngineCore: the scheduler and an executor in one busy loop, token ids only.

`step()` is the whole engine: schedule, launch, sample, finish, update. The offline LLM
calls it in-process; the server runs it in its own process behind a ZMQ socket
(engine/core_proc.py).

Launched steps wait in one queue (engine/step_queue.py) whose depth decides how steps overlap:
1 runs one step at a time; 2 is async scheduling: `step()` schedules and launches step N+1,
then finishes step N and applies its results, so the host's scheduling and bookkeeping run
while the device computes (step N+1 takes the tokens of step N on the device; a request that
stops at step N has computed one token too many in step N+1, which is dropped); P is
pipeline parallelism's micro-batches. Requests whose sampling reads every earlier token
(penalties, min_tokens) bring the depth to 1 while they run. With speculative decoding,
steps that verify drafts run one at a time (their drafts come from the results of the step
before, and their accepted count decides the next inputs) and steps without drafts are
pipelined: speculation that does not pay (the adaptive budget and the backoff turned it off)
costs no more than plain decoding."""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any

from shoal.config import EngineConfig
from shoal.core.executor import Executor
from shoal.core.kv_cache_spec import KVCacheLayout
from shoal.core.request import Request
from shoal.core.types import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from shoal.engine.core_lora import CoreLoRA
from shoal.engine.dp_lockstep import join_dp_lockstep
from shoal.engine.encoder_schedule import encoder_cache_size, whole_spans
from shoal.engine.generation_defaults import GenerationDefaults
from shoal.engine.pause import GenerationPause
from shoal.engine.pooling_scheduler import PoolingScheduler
from shoal.engine.request_checks import EngineLimits, RequestLimits, validate_core_request
from shoal.engine.request_errors import EngineDeadError
from shoal.engine.scheduler import Scheduler
from shoal.engine.startup_heap import (
    freeze_startup_heap,
    refreeze_if_thawed,
    release_startup_heap,
)
from shoal.engine.step_queue import LaunchedStep, StepQueue
from shoal.engine.structured_steps import StructuredSteps
from shoal.engine.warm_requests import warm_request_path
from shoal.executor import build_model_executor
from shoal.kv_offload.factory import build_kv_offload
from shoal.loader import LoadedModel
from shoal.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

# Steps that raise in a row before the engine checks itself (Executor.check_health: a step of
# one made-up token, forward and sampling): requests that fail alone are the usual cause, and
# the engine serves on; a check that fails too means every request would, and it stops.
CHECK_AFTER_FAILED_STEPS = 4


class EngineCore(CoreLoRA):  # (add/remove/pin/list_loras: engine/core_lora.py)
    def __init__(self, config: EngineConfig, loaded: LoadedModel,
                 request_limits: RequestLimits | None = None,
                 generation: GenerationDefaults | None = None):
        """request_limits: what one request may ask for (RequestLimits.from_engine_args);
        generation: what they inherit from the model's generation_config.json. The
        frontends read both from `limits`."""
        t0 = time.perf_counter()
        request_limits = request_limits or RequestLimits()
        self.config = config
        pooling = config.model_config.runner == "pooling"
        self.kv_offload = self.kv_transfer = None
        # DP+EP: the replicas' process group and per-step agreement (engine/dp_lockstep.py),
        # joined before the model is built; None otherwise.
        self.dp_lockstep = join_dp_lockstep(config)
        self.runner: Executor = build_model_executor(config, loaded)
        if self.dp_lockstep is not None:  # a drafter's passes, expert LoRA slots agreed
            self.runner.lockstep_drafts(self.dp_lockstep.agree_max)
            self.runner.lockstep_loras(self.dp_lockstep.agree_max)
        try:
            layout = self.runner.initialize_kv_cache()
            self.scheduler: Scheduler | PoolingScheduler = (
                self._pooling_scheduler(request_limits) if pooling else
                self._scheduler(layout, loaded, request_limits))
        except BaseException:  # worker ranks and process groups do not outlive a failed start
            self.runner.shutdown()
            raise
        spec = config.speculative_config
        # Pooling requests take one step each.
        self.async_scheduling = config.async_scheduling and not pooling
        self._speculating = spec is not None
        self._proposals_known = spec is not None and spec.proposes_only_on_repeats
        self._drafter_kv = spec is not None and spec.drafts_with_kv
        self.micro_batches = config.parallel_config.pipeline_parallel_size
        self.queue = StepQueue()
        self.last_step_idle = False  # (_run_step: nothing launched, finished or waited for)
        self._history_requests: set[int] = set()  # serials: sampling needs every earlier token
        self._failed_in_a_row = 0
        self.pause = GenerationPause.attached(self.scheduler)  # engine/pause.py
        self.thread_governor: Any = None  # CPU: engine/cpu_governor.py (set at start-up)
        self.eos_token_ids = loaded.eos_token_ids()
        self.structured = StructuredSteps(StructuredOutputManager(
            config.structured_outputs_backend, loaded.tokenizer, self.runner.vocab_size,
            sorted(self.eos_token_ids), pin_memory=config.device.type == "cuda"))
        sc = config.scheduler_config
        # What every frontend validates requests against (sent in the ready message).
        self.limits = EngineLimits(
            vocab_size=self.runner.vocab_size, max_model_len=sc.max_model_len,
            num_kv_blocks=layout.num_blocks, block_size=config.cache_config.block_size,
            max_num_seqs=sc.max_num_seqs, eos_token_ids=self.eos_token_ids,
            state_groups=sum(g.holds_state for g in layout.groups),
            max_num_batched_tokens=sc.max_num_batched_tokens,
            request=request_limits, pooling=self.runner.pooling_info,
            lora=self.runner.lora_limits,
            mm_max_embeds=encoder_cache_size(config, loaded.hf_config),
            mm_whole_spans=whole_spans(loaded.hf_config),
            generation=(generation or GenerationDefaults()).within(self.runner.vocab_size))
        self.startup_times = self.runner.startup_times  # each start-up phase's seconds
        if config.device.type == "cuda" and not pooling:
            t1 = time.perf_counter()
            warm_request_path(self)
            self.startup_times["warm_requests"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        freeze_startup_heap(self)  # (thawed at shutdown: engine/startup_heap.py)
        self.startup_times["freeze_heap"] = time.perf_counter() - t1
        logger.info("engine core ready in %.2f s (max_num_batched_tokens %d, max_num_seqs %d)",
                    time.perf_counter() - t0, sc.max_num_batched_tokens, sc.max_num_seqs)

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    def _pooling_scheduler(self, request_limits: RequestLimits) -> PoolingScheduler:
        """Prefill-only requests, no KV cache (see pooling_scheduler.py)."""
        return PoolingScheduler(self.config.scheduler_config,
                                request_timeout=request_limits.request_timeout)

    def _scheduler(self, layout: KVCacheLayout, loaded: LoadedModel,
                   request_limits: RequestLimits) -> Scheduler:
        """The generation scheduler over the device KV pool, with the secondary KV tiers
        (CPU, then disk...) when kv_offloading_size is set."""
        config = self.config
        offload = build_kv_offload(config, self.runner.kv_cache_tensors(), loaded,
                                   layout.groups)
        if offload is not None:
            self.kv_offload, self.kv_transfer = offload.store, offload.transfer
            self.runner.use_kv_transfer(offload.transfer)
            # An engine dropped without shutdown() (or alive at interpreter exit) still writes
            # its CPU tier down (shutdown() does more first, and this then does nothing).
            weakref.finalize(self, offload.store.shutdown)
        spec = config.speculative_config
        return Scheduler(config.scheduler_config, config.cache_config, layout.num_blocks,
                         kv_store=self.kv_offload,
                         request_timeout=request_limits.request_timeout,
                         num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
                         spec_adaptive=spec is None or spec.adaptive_budget,
                         spec_disable_by_batch_size=spec.disable_by_batch_size
                         if spec is not None else None,
                         spec_confidence=spec.confidence_threshold if spec else None,
                         micro_batches=config.parallel_config.pipeline_parallel_size,
                         kv_groups=layout.groups,
                         encoder_cache_size=encoder_cache_size(config, loaded.hf_config),
                         whole_spans=whole_spans(loaded.hf_config), pipelined=config.async_scheduling)

    def run_until_idle(self) -> None:
        while self.has_unfinished_requests():
            self.step()

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        if self.sleep_level:
            raise ValueError("the engine is asleep: wake_up() before sending requests")
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
            lora=self.versioned_lora(req.lora),  # (engine/core_lora.py)
            mm_features=req.mm_features,
        )
        params = req.sampling_params.structured_outputs
        if params is not None:
            request.structured = self.structured.manager.request(params)
        self.scheduler.add_request(request)  # gives it its serial
        if req.sampling_params.needs_output_history:
            self._history_requests.add(request.serial)
        if request.structured is not None:
            self.structured.add(request)

    # ---- the RL lifecycle (shoal/worker/lifecycle.py) ---------------------------------------
    sleep_level = 0  # 0: awake
    kv_events: Any = None  # engine/kv_events.py: KVEvents, when kv_events_config enables them
    kv_connector: Any = None  # shoal/kv_transfer: KV from and for other engines

    def _require_idle(self, what: str) -> None:
        if self.has_unfinished_requests():
            raise ValueError(f"{what} needs an idle engine: requests are still running or "
                             "waiting (let them finish or abort them first)")

    def sleep(self, level: int = 1) -> dict[str, Any]:
        """Frees the KV cache and the weights (level 1 keeps them in host memory); the
        prefix cache is emptied, since the blocks' contents are gone."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2 (got {level!r})")
        self._require_idle("sleep")
        if self.sleep_level:
            raise ValueError("the engine is asleep already")
        result = self.runner.collective_rpc("sleep", [level])[0]
        self.reset_prefix_cache()
        self.sleep_level = level
        return result

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.runner.collective_rpc("wake_up", [tags])
        if not self.runner.collective_rpc("rank_info", [])[0]["sleeping"]:
            self.sleep_level = 0

    def collective_rpc(self, method: str, args: list[Any] | None = None) -> list[Any]:
        """A lifecycle method on every rank. A weight update empties the prefix cache and the
        KV tiers (their blocks were computed with the old weights)."""
        args = list(args or ())
        if method == "sleep":  # the engine's sleep state follows
            return [self.sleep(*args)]
        if method == "wake_up":
            self.wake_up(*args)
            return [None]
        if method.startswith("update_weights"):
            self._require_idle(method)
        results = self.runner.collective_rpc(method, args)
        if method.startswith("update_weights"):
            self.reset_prefix_cache()
        return results

    def update_weights(self, weights: Any) -> int:
        """Checkpoint-named tensors (a dict or (name, tensor) pairs) into every rank's model:
        directly on one rank, through a shared-memory safetensors file over several."""
        self._require_idle("update_weights")
        pairs = weights.items() if hasattr(weights, "items") else weights
        if hasattr(self.runner, "update_weights"):  # the model in this process (one rank)
            count = self.runner.update_weights(pairs)
            self.reset_prefix_cache()
            return count
        import tempfile

        from safetensors.torch import save_file

        tensors = {name: t.detach().contiguous().cpu() for name, t in pairs}
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.TemporaryDirectory(dir=where, prefix="shoal-weights-") as folder:
            file = os.path.join(folder, "update.safetensors")
            save_file(tensors, file)
            return self.collective_rpc("update_weights_from_file", [file])[0]

    def pause_generation(self, wait_for_inflight_requests: bool = False,
                         clear_cache: bool = True) -> None:
        """Aborts (or lets finish) the live requests and admits no new ones (pause.py)."""
        self.pause.pause(self, wait_for_inflight_requests, clear_cache)

    def resume_generation(self) -> None:
        self.pause.resume()

    def reset_prefix_cache(self) -> bool:
        """Drops every cached block (device and KV tiers); False while requests hold blocks."""
        done = self.scheduler.kv.reset_prefix_cache()
        if done and self.kv_offload is not None:
            self.kv_offload.clear()
        if done and getattr(self.scheduler, "encoders", None) is not None:
            self.scheduler.encoders.reset()  # images' encoder outputs: the runner's next step
        return done

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        """Work of this engine's own, or (DP+EP) of another replica at the last round."""
        return self._has_local_work() or (self.dp_lockstep is not None
                                          and self.dp_lockstep.group_busy)

    def _has_local_work(self) -> bool:  # (paused, held requests are no work: pause.py)
        return bool(self.queue) or (self.scheduler.has_unfinished_requests()
                                    and not self.pause.idle(self.scheduler))

    def shutdown(self) -> None:
        """Between steps, before the process exits: finishes the steps in flight (their KV
        copies are then done and reported to the scheduler) and writes the CPU KV tier down to
        the lower tiers, so a restart finds those blocks."""
        try:
            while self.queue:
                self._finish_oldest()
            self.structured.shutdown()
            if self.kv_offload is not None:
                self.kv_offload.shutdown()
            if self.kv_connector is not None:
                self.kv_connector.shutdown()
        finally:  # whatever failed above, the ranks stop and leave their process group
            self.runner.shutdown()
            if self.dp_lockstep is not None:
                self.dp_lockstep.shutdown()
            release_startup_heap(self)

    # ---- the loop body ----------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        refreeze_if_thawed()  # after another engine in this process stopped
        lockstep = self.dp_lockstep  # DP+EP: every replica steps, or none (dp_lockstep.py)
        if lockstep is not None and not lockstep.begin_step(self._has_local_work(), self.runner):
            return self._idle_round()
        self.pause.check_step(self)
        try:
            outputs = self._run_step()
        except Exception as e:  # one bad request or a bug: never the whole engine
            if lockstep is not None:  # ...except under DP+EP: the replicas' collectives broke
                raise
            outputs = self._recover(e)
        if lockstep is not None:
            lockstep.end_step(self.runner)  # the dummy forward of a replica with nothing run
        outputs = self.scheduler.take_pending_outputs() + outputs
        if self.kv_events is not None:  # the step's prefix-cache changes (engine/kv_events.py)
            self.kv_events.publish()
        self._forget_finished()
        stats = self.scheduler.stats()
        if self.kv_offload is not None:
            stats.kv_tiers = {t.name: t.as_metrics() for t in self.kv_offload.stats().tiers}
        self.pause.settle(self)
        if self.thread_governor is not None:
            self.thread_governor.after_step()
        return EngineCoreOutputs(outputs=outputs, stats=stats)

    def _idle_round(self) -> EngineCoreOutputs:
        """DP+EP, every replica idle: no step; outputs of requests ended meanwhile (aborts),
        and no stats unless there are some (the serving loop then sends nothing)."""
        outputs = self.scheduler.take_pending_outputs()
        self._forget_finished()
        return EngineCoreOutputs(outputs=outputs,
                                 stats=self.scheduler.stats() if outputs else None)

    def _forget_finished(self) -> None:
        """Requests that ended (finished or aborted) release their runner state now."""
        finished = self.scheduler.take_finished_serials()
        self.runner.remove_requests(finished)
        self._history_requests -= finished
        self.structured.remove(finished)

    def _run_step(self) -> list[EngineCoreOutput]:
        """Schedules and launches a step while the queue has room, then finishes the oldest
        step once the queue is full or nothing more could be launched."""
        if self.structured.compiling:
            self.structured.check(self.scheduler.fail_request)
        depth = self._depth()
        launched = None
        worked = bool(self.queue)  # (finishing one in flight is work, output or not)
        if len(self.queue) < depth:
            # (under micro-batches no request has a token in flight when it is scheduled)
            sched = self.scheduler.schedule(allow_drafts=not self.queue or self.micro_batches > 1)
            if not sched.is_empty:
                launched = self.queue.push(sched)  # before it runs: _recover fails it then
                launched.handle = self.runner.execute(sched)
                self._sample_ready()
            elif not self.queue and self.structured.compiling:
                self.structured.wait_compiling()  # nothing to run but grammars
                worked = True
        outputs: list[EngineCoreOutput] = []
        if self.queue and (launched is None or len(self.queue) >= depth):
            outputs = self._finish_oldest()
            self._sample_ready()
        # (idle: every unfinished request waits on something outside the step; core_proc.py)
        self.last_step_idle = launched is None and not worked and not outputs
        return outputs

    def _depth(self) -> int:
        """How many steps may be in flight. One unless async scheduling (or pipeline
        stages): not while a request's sampling reads every earlier token (penalties,
        min_tokens; a grammar needs only the last, see structured_steps.py), not behind a
        verify step (its accepted drafts decide where the next inputs start), and not when
        the next step would verify drafts, which are proposed from the step before it; nor
        behind a step saving KV for another engine with a drafter of layers, whose rows are
        read at that step's finish (kv_transfer/draft_rows.py): a step launched before it could
        hand the saved blocks to another request first."""
        if self.micro_batches > 1:
            return self.micro_batches
        if not self.async_scheduling or self._history_requests:
            return 1
        if self._drafter_kv and any(s.sched.kv_connector is not None
                                    and s.sched.kv_connector.saves for s in self.queue):
            return 1
        if self._speculating and (any(s.sched.has_drafts for s in self.queue)
                                  or self.scheduler.wants_drafts(self._proposals_known)):
            return 1
        return 2

    def _sample_ready(self) -> None:
        """Samples the launched steps that can be: all but a step whose structured rows wait
        for the tokens of a step ahead of it, which is sampled once it is the oldest."""
        for i, step in enumerate(self.queue):
            if not step.sampled and (i == 0 or not self.structured.waits_for_step_ahead(
                    step.sched)):
                self._sample(step)

    def _sample(self, step: LaunchedStep) -> None:
        # The bitmask is filled here, on the host, while the device runs the forward pass.
        grammar = self.structured.bitmask(step.sched, self.scheduler.request_by_serial)
        self.runner.sample(step.handle, grammar)
        step.sampled = True

    def _finish_oldest(self) -> list[EngineCoreOutput]:
        """The oldest step's results into the scheduler; it leaves the queue once applied."""
        step = self.queue.oldest()
        if not step.sampled:
            self._sample(step)
        outputs = self.scheduler.update(step.sched, self.runner.finish(step.handle))
        self.queue.pop_oldest()
        self._failed_in_a_row = 0
        return outputs

    def _recover(self, error: Exception) -> list[EngineCoreOutput]:
        """A step raised: the requests of every step not applied yet are rerun one by one,
        and the one that raises alone fails (engine/suspects.py); the rest keep serving.
        When steps keep failing whatever they hold, the engine is broken: it stops."""
        self._failed_in_a_row += 1
        logger.exception("an engine step failed; its requests are retried one at a time")
        scheds = self.queue.drain()
        self.runner.reset_after_fault()  # (and its encoder cache, which the books follow:)
        if getattr(self.scheduler, "encoders", None) is not None:
            self.scheduler.encoders.reset()
        if self._failed_in_a_row >= CHECK_AFTER_FAILED_STEPS:
            self._check_health(error)
        outputs, serials = self.scheduler.fail_steps(scheds, f"{type(error).__name__}: {error}")
        self.runner.remove_requests(serials)
        return outputs

    def _check_health(self, error: Exception) -> None:
        try:
            self.runner.check_health()
        except Exception as e:
            raise EngineDeadError(f"{self._failed_in_a_row} steps failed in a row ({error!r}) "
                                  f"and a step of one made-up token fails too ({e!r}): the "
                                  "engine cannot serve") from e
        logger.warning("%d steps failed in a row, but a made-up step runs: the requests are at "
                       "fault, and the engine serves on", self._failed_in_a_row)
        self._failed_in_a_row = 0

