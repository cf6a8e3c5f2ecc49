"""The synchronous engine behind the offline LLM: frontend processing and an in-process core."""

from __future__ import annotations

import atexit
import itertools
import logging
import time
import weakref
from typing import Any

from shoal.core.types import SchedulerStats
from shoal.engine.engine_args import EngineArgs
from shoal.engine.input_processor import InputProcessor, ProcessedRequest, PromptType
from shoal.engine.mm_frontend import MultiModalFrontend
from shoal.engine.output_processor import OutputKind, OutputProcessor
from shoal.engine.startup import start_engine_core
from shoal.lora_request import LoRARequest
from shoal.metrics.offline import OfflineStats
from shoal.metrics.stats import IterationStats
from shoal.outputs import RequestOutput
from shoal.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, args: EngineArgs):
        t0 = time.perf_counter()
        self._shut_down = False
        # (Plain data parallelism runs behind `shoal serve`; offline, DP+EP runs one LLM per
        # replica: shoal/engine/compatibility.py refuses the rest.)
        started = start_engine_core(args, serving=False)
        self.config = started.core.config
        self.tokenizer = started.tokenizer
        self.core = started.core
        self.inputs = InputProcessor(self.tokenizer, self.core.limits,
                                     max_logprobs=args.max_logprobs,
                                     mm=MultiModalFrontend.build(
                                         args.model, self.tokenizer,
                                         self.core.limits.mm_max_embeds, args))
        self.outputs = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        self.last_stats: SchedulerStats | None = None
        self.stats = None if args.disable_log_stats else OfflineStats(args, self.core.limits)
        # KV tiers persist at interpreter exit if the engine is still alive then.
        atexit.register(_shutdown_if_alive, weakref.ref(self))
        logger.info("engine ready in %.2f s", time.perf_counter() - t0)

    def shutdown(self) -> None:
        """Finishes a step in flight and persists the CPU KV tier to disk (if configured).
        Idempotent; the engine takes no more requests afterwards."""
        if not self._shut_down:
            self._shut_down = True
            self.core.shutdown()

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                    priority: int = 0, cache_salt: str | None = None,
                    kind: OutputKind = OutputKind.FINAL_ONLY,
                    lora_request: LoRARequest | None = None) -> None:
        """Validates everything before anything reaches the core, so a bad request leaves no
        trace."""
        self.submit(self.process_request(request_id, prompt, params, priority=priority,
                                         cache_salt=cache_salt, lora_request=lora_request), kind)

    def process_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                        priority: int = 0, cache_salt: str | None = None,
                        lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """inputs.process_request, and a grammar that does not compile is a ValueError here
        (it stays cached for the request)."""
        if self.core.sleep_level:
            raise ValueError("the engine is asleep: wake_up() before sending requests")
        processed = self.inputs.process_request(request_id, prompt, params, priority=priority,
                                                cache_salt=cache_salt, lora_request=lora_request)
        if params.structured_outputs is not None:
            self.core.structured.manager.validate(params.structured_outputs)
        return processed

    def submit(self, req: ProcessedRequest, kind: OutputKind = OutputKind.FINAL_ONLY) -> None:
        """Hands a request validated by `inputs.process_request` to the core."""
        self.outputs.add_request(req, kind)
        for r in req.core_requests:
            self.core.add_request(r)

    def abort_request(self, request_id: str) -> None:
        self.core.abort_requests(self.outputs.abort(request_id))

    # ---- LoRA adapters (vLLM's; the offline LLM reaches them as llm.llm_engine.add_lora)
    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Loads the adapter on every rank ahead of its requests; ValueError naming it when
        it cannot be served (the engine serves on)."""
        return self.core.add_lora(lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """False when it was not loaded, or while requests still run or wait with it."""
        return self.core.remove_lora(lora_id)

    def list_loras(self) -> set[int]:
        return self.core.list_loras()

    def pin_lora(self, lora_id: int) -> bool:
        """Never evicted (host memory, device slot) until removed; ValueError when it is not
        loaded or would take the last unpinned slot (shoal/engine/core_lora.py)."""
        return self.core.pin_lora(lora_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or self.outputs.has_unfinished()

    def join_replicas(self) -> None:
        """DP+EP: step with the other replicas until all of them are idle, even with no
        request of this one's own (the start of a generate call on every rank)."""
        lockstep = getattr(self.core, "dp_lockstep", None)
        if lockstep is not None:
            lockstep.rejoin()

    def step(self) -> list[RequestOutput]:
        result = self.core.step()
        if result.stats is not None:  # None: an idle DP+EP round
            self.last_stats = result.stats
        it = None if self.stats is None else IterationStats()
        outs, to_abort = self.outputs.process_outputs(result.outputs, it)
        if to_abort:
            self.core.abort_requests(to_abort)
        if self.stats is not None:
            self.stats.record(result.stats, it)
        return outs

    @property
    def metrics_registry(self) -> Any:
        """The registry get_metrics reads (None: disable_log_stats)."""
        return None if self.stats is None else self.stats.registry


def _shutdown_if_alive(ref: weakref.ref) -> None:
    engine = ref()
    if engine is not None:
        engine.shutdown()
