"""The Executor interface (shoal/core/executor.py) for executors whose rank 0 is a ModelRunner in
this process (the driver) and whose other ranks take the same commands (mp: worker
processes; ray: actors).

Each step is broadcast to the other ranks, then run by the driver; the collectives inside
the model keep the ranks in lockstep and only the driver's sampled tokens are read (the
scheduler sends every rank its input tokens: no async scheduling with several ranks).
Subclasses send commands (`_broadcast`) and may turn a driver error into the death of a rank
(`_driver_failed`) or look for one before a reset (`_before_reset`).

Pipeline parallelism: the driver's execute() returns once stage 0 has sent the step on;
sampling waits for the last stage's hidden states, so it happens in finish(), after the
core has launched the next micro-batch; every rank finishes its step then (FinishStep), so
stage 0's other tensor-parallel ranks gather the logits with the driver."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shoal.core.executor import Executor
from shoal.core.kv_cache_spec import KVCacheLayout
from shoal.core.scheduler_output import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from shoal.executor.commands import (
    AddLoRA,
    CheckHealth,
    CollectiveRPC,
    FinishStep,
    InitKVCache,
    PinLoRA,
    RemoveLoRA,
    RemoveRequests,
    ResetAfterFault,
    RunStep,
)
from shoal.executor.rpc import check_rpc_method, gather_rpc
from shoal.lora_request import LoRARequest
from shoal.worker.model_runner import ModelRunner
from shoal.worker.step_handle import StepHandle


@dataclass
class StagedStep:
    """Pipeline parallelism: a launched step whose sampling waits for finish()."""

    handle: StepHandle
    grammar: GrammarBitmask | None = None


class DriverExecutor(Executor):
    driver: ModelRunner  # (a PoolingModelRunner for a pooling model: the same calls)

    def _broadcast(self, cmd: Any) -> None:
        raise NotImplementedError

    def _driver_failed(self, exc: BaseException) -> None:
        """Called when the driver's part of a step raised; may raise a better error."""
        return None

    def _before_reset(self) -> None:
        """Called when a step failed, before the ranks reset."""
        return None

    @property
    def vocab_size(self) -> int:  # type: ignore[override]
        return self.driver.vocab_size

    @property
    def startup_times(self) -> dict[str, float]:  # type: ignore[override]
        return self.driver.startup_times

    @property
    def num_forwards(self) -> int:
        return self.driver.num_forwards

    @property
    def pooling_info(self) -> Any:  # type: ignore[override]
        return self.driver.pooling_info

    @property
    def lora_limits(self) -> Any:  # type: ignore[override]
        return self.driver.lora_limits

    def collective_rpc(self, method: str, args: list[Any]) -> list[Any]:
        check_rpc_method(method)
        self._broadcast(CollectiveRPC(method, list(args)))
        return gather_rpc(self.driver, method, list(args), raise_errors=True)

    # LoRA: the driver first, so that a bad adapter or a refused pin raises here and never
    # reaches the other ranks (they hold what the driver holds: the same calls, in order).
    # No collective: under pipeline parallelism steps may be in flight meanwhile.
    def add_lora(self, lora: LoRARequest) -> bool:
        added = self.driver.add_lora(lora)
        self._broadcast(AddLoRA(lora))
        return added

    def pin_lora(self, lora_id: int) -> bool:
        pinned = self.driver.pin_lora(lora_id)
        self._broadcast(PinLoRA(lora_id))
        return pinned

    def remove_lora(self, lora_id: int) -> bool:
        self._broadcast(RemoveLoRA(lora_id))
        return self._on_driver(self.driver.remove_lora, lora_id)

    def list_loras(self) -> set[int]:
        return self.driver.list_loras()

    @property
    def pipelined(self) -> bool:
        return self.driver.pipelined

    def initialize_kv_cache(self) -> KVCacheLayout:
        self._broadcast(InitKVCache())
        return self.driver.initialize_kv_cache()

    def execute(self, sched: SchedulerOutput) -> StepHandle | StagedStep:
        # An adapter that cannot be read fails the step here, before any rank starts it (the
        # ranks read the same folders: past this point they find them readable too).
        self._on_driver(self.driver.load_step_loras, sched)
        self._broadcast(RunStep(sched))
        handle = self._on_driver(self.driver.execute, sched)
        return StagedStep(handle) if self.pipelined else handle

    def sample(self, handle: StepHandle | StagedStep, grammar: GrammarBitmask | None) -> None:
        if isinstance(handle, StagedStep):
            handle.grammar = grammar
            return
        self.driver.sample(handle, grammar)

    def finish(self, handle: StepHandle | StagedStep) -> ModelRunnerOutput:
        if not isinstance(handle, StagedStep):
            return self.driver.finish(handle)
        # The ranks finish their oldest step now; the driver waits here for the last stage,
        # so a peer that died shows here.
        self._broadcast(FinishStep())
        self._on_driver(self.driver.sample, handle.handle, handle.grammar)
        return self._on_driver(self.driver.finish, handle.handle)

    def _on_driver(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as exc:
            self._driver_failed(exc)
            raise

    def remove_requests(self, serials: set[int]) -> None:
        if serials:
            self._broadcast(RemoveRequests(sorted(serials)))
        self.driver.remove_requests(serials)

    def reset_after_fault(self) -> None:
        self._before_reset()
        self._broadcast(ResetAfterFault())
        self.driver.reset_after_fault()

    def check_health(self) -> None:
        self._broadcast(CheckHealth())
        self._on_driver(self.driver.check_health)

    def kv_cache_tensors(self) -> list[Any]:
        return self.driver.kv_cache_tensors()
