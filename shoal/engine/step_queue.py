"""The engine core's queue of launched steps, oldest first (vLLM's batch queue): of depth 1
(one step at a time), 2 (async scheduling: step N+1 is scheduled and launched while the
device runs step N) or P (pipeline parallelism: up to P micro-batches in flight, one per
stage). A step enters before the executor runs it, so a step that raises is still there to
be failed (engine/core.py's recovery), and leaves once its results are applied."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from shoal.core.scheduler_output import SchedulerOutput


@dataclass
class LaunchedStep:
    sched: SchedulerOutput
    handle: Any = None  # the executor's, once execute() returned
    sampled: bool = False


class StepQueue:
    def __init__(self) -> None:
        self._steps: deque[LaunchedStep] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[LaunchedStep]:
        return iter(self._steps)

    def push(self, sched: SchedulerOutput) -> LaunchedStep:
        step = LaunchedStep(sched)
        self._steps.append(step)
        return step

    def oldest(self) -> LaunchedStep:
        return self._steps[0]

    def pop_oldest(self) -> LaunchedStep:
        return self._steps.popleft()

    def drain(self) -> list[SchedulerOutput]:
        """Empties the queue; returns the steps' schedules (a step failed: none of them will
        ever be applied)."""
        scheds = [s.sched for s in self._steps]
        self._steps.clear()
        return scheds
