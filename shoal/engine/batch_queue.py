"""Pipeline micro-batches: up to pipeline_parallel_size steps in flight (vLLM's batch queue).

With the decoder layers split over stages, one step at a time leaves every stage idle while
the others run that step: pipeline parallelism then brings memory, not throughput. So the
engine keeps a queue of launched steps: while it has room, it schedules and launches another
step without waiting; when it is full, or the scheduler finds nothing more to run, it waits
for the oldest step and applies its results. The executor's launch() returns once stage 0 has
run its layers and sent the activations on; the last stage's hidden states come back and are
sampled in finish() (shoal/worker/stage_link.py). So stage 0 runs micro-batch N+1 while the
later stages run N.

The scheduler puts no request in two steps in flight (Scheduler's micro_batches), so every
step's input tokens are known on the host and the steps in flight hold disjoint requests;
each step takes an even share of them, so the micro-batches stay balanced."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from shoal.core.scheduler_output import SchedulerOutput
from shoal.core.types import EngineCoreOutput

if TYPE_CHECKING:
    from shoal.core.request import Request
    from shoal.engine.scheduler import Scheduler
    from shoal.structured_output.manager import StructuredOutputManager


class BatchQueue:
    """Launched steps, oldest first: (SchedulerOutput, the runner's StepFuture)."""

    def __init__(self, depth: int):
        self.depth = depth
        self._steps: deque[tuple[SchedulerOutput, Any]] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def has_room(self) -> bool:
        return len(self._steps) < self.depth

    def push(self, sched: SchedulerOutput, fut: Any) -> None:
        self._steps.append((sched, fut))

    def pop(self) -> tuple[SchedulerOutput, Any]:
        return self._steps.popleft()

    def clear(self) -> None:
        self._steps.clear()


class MicroBatching:
    """Mixed into EngineCore: its step with a batch queue (pipeline_parallel_size > 1)."""

    batch_queue: BatchQueue | None = None  # set with pipeline_parallel_size > 1
    scheduler: Scheduler
    runner: Any
    structured: StructuredOutputManager
    _unsettled: list[SchedulerOutput]
    _compiling: dict[int, Request]
    _structured_serials: set[int]
    # and EngineCore's _check_grammars, _grammar_bitmask

    def _step_with_batch_queue(self) -> list[EngineCoreOutput]:
        queue = self.batch_queue
        assert queue is not None
        if self._compiling:
            self._check_grammars()
        if queue.has_room():
            sched = self.scheduler.schedule()
            if not sched.is_empty:
                if self._structured_serials:
                    sched.grammar_bitmask = self._grammar_bitmask(sched)
                self._unsettled.append(sched)  # _recover reruns it if anything raises
                queue.push(sched, self.runner.launch(sched))
                if queue.has_room():
                    return []  # the next micro-batch before waiting for this one
            elif not queue:
                if self._compiling:  # nothing to run but grammars
                    self.structured.wait_any([r.structured for r in self._compiling.values()],
                                             0.01)
                return []
        return self._finish_oldest_step()

    def _finish_oldest_step(self) -> list[EngineCoreOutput]:
        assert self.batch_queue is not None
        sched, fut = self.batch_queue.pop()
        outputs = self.scheduler.update(sched, self.runner.finish(fut))
        self._unsettled = [s for s in self._unsettled if s is not sched]
        return outputs

    def _drain_batch_queue(self) -> None:
        """Finishes every step in flight (shutdown)."""
        while self.batch_queue:
            self._finish_oldest_step()
