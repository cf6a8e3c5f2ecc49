"""The runner's interface for executors whose rank 0 is a ModelRunner in this process (the
driver) and whose other ranks take the same commands (mp: worker processes; ray: actors).

Each call is broadcast to the other ranks, then run by the driver; anything else (vocab_size,
kv_caches, startup_times, ...) is the driver's. Subclasses send commands (`_broadcast`) and may
turn a driver error into the death of a rank (`_driver_failed`) or look for one before a
reset (`_before_reset`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from shoal.core.scheduler_output import SchedulerOutput
from shoal.executor.commands import (
    FinishStep,
    InitKVCache,
    RemoveRequests,
    ResetAfterFault,
    RunStep,
)


class DriverExecutor:
    driver: Any  # the rank-0 ModelRunner

    def _broadcast(self, cmd: Any) -> None:
        raise NotImplementedError

    def _driver_failed(self, exc: BaseException) -> None:
        """Called when the driver's part of a step raised; may raise a better error."""

    def _before_reset(self) -> None:
        """Called when a step failed, before the ranks reset."""

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the class does not define.
        if name == "driver":
            raise AttributeError(name)
        return getattr(self.driver, name)

    def initialize_kv_cache(self) -> int:
        self._broadcast(InitKVCache())
        return self.driver.initialize_kv_cache()

    def launch(self, sched: SchedulerOutput) -> Any:
        # The grammar bitmask only shapes rank 0's sampling (the other ranks' tokens are
        # never read), and its fill callback does not cross processes.
        self._broadcast(RunStep(dataclasses.replace(sched, grammar_bitmask=None)))
        try:
            return self.driver.launch(sched)
        except Exception as exc:
            self._driver_failed(exc)
            raise

    def finish(self, fut: Any, propose: bool = True) -> Any:
        if self.driver.stage_link is None:
            return self.driver.finish(fut, propose=propose)
        # Pipeline parallel: the ranks finish their steps when the driver does (FinishStep);
        # the driver waits here for the last stage, so a peer that died shows here.
        self._broadcast(FinishStep())
        try:
            return self.driver.finish(fut, propose=propose)
        except Exception as exc:
            self._driver_failed(exc)
            raise

    def sample_deferred(self, fut: Any) -> None:
        self.driver.sample_deferred(fut)

    def execute(self, sched: SchedulerOutput) -> Any:
        return self.finish(self.launch(sched))

    def remove_requests(self, serials: set[int]) -> None:
        if serials:
            self._broadcast(RemoveRequests(sorted(serials)))
        self.driver.remove_requests(serials)

    def reset_after_fault(self) -> None:
        self._before_reset()
        self._broadcast(ResetAfterFault())
        self.driver.reset_after_fault()

    def use_kv_transfer(self, transfer: Any) -> None:
        raise ValueError("KV offloading does not support tensor_parallel_size > 1 yet")
