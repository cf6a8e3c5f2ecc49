"""Fewer model threads while other processes take CPU from the engine, more once they stop.

A parallel region of n OpenMP threads ends when its slowest thread does. With a neighbour
on one of the engine's cores, that thread gets a share of its core in slices of
milliseconds while the others spin: bfloat16 decode on 2 cores fell from 80 to 19-30 tok/s
beside one busy-looping process, where one thread alone keeps 63 (cpu_threads.py). The
engine therefore measures, every half second of steps, how much of its CPUs other processes
used (cpu_share.py: the machine's busy time on those CPUs, less this process's own, plus
the hypervisor's steal) and runs on the CPUs they leave free:
- down at once when the free CPUs are fewer than the threads less DOWN_MARGIN (a
  neighbour on 0.35 of a core already stalls every region);
- up when the free CPUs reach the threads plus 1 - UP_MARGIN in two windows in a row (a
  neighbour's short burst does not flip the count back and forth);
- never above the count chosen at start (cpu_threads.py), never below 1.
The count changes between steps only (a long prefill step is measured whole), and a window
that spans idle time is measured too: a neighbour that ran meanwhile shows in its average.
SHOAL_CPU_ADAPTIVE_THREADS=0 turns it off (A/B runs); an explicit `cpu_threads` pins the
count."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal import envs
from shoal.engine.cpu_quota import affinity_cpus
from shoal.engine.cpu_share import CpuShareMeter
from shoal.engine.cpu_threads import set_model_threads

logger = logging.getLogger(__name__)

INTERVAL_S = 0.5  # seconds of steps per measurement
DOWN_MARGIN = 0.35  # cores lost under the threads that send the count down
UP_MARGIN = 0.15  # cores short of one more thread at which the count goes up
UP_CONFIRM = 2  # windows in a row that must allow more threads


def next_thread_count(current: int, ceiling: int, free_cores: float) -> int:
    """The count the free cores allow, with the margins above (one window's view)."""
    if free_cores < current - DOWN_MARGIN:
        return max(1, min(current - 1, math.floor(free_cores + DOWN_MARGIN)))
    if current < ceiling and free_cores >= current + 1 - UP_MARGIN:
        return min(ceiling, math.floor(free_cores + UP_MARGIN))
    return current


@dataclass
class ThreadGovernor:
    """after_step() once per engine step, on the thread that runs the model. The meter's
    first reading (its baseline) is taken when the governor is made."""

    ceiling: int
    meter: CpuShareMeter
    set_threads: Callable[[int], None] = set_model_threads
    clock: Callable[[], float] = time.monotonic
    threads: int = 0  # the count now (the ceiling at start)
    changes: int = 0
    seconds_at: dict[int, float] = field(default_factory=dict)  # thread count -> seconds run
    _window_start: float = 0.0
    _ups: int = 0

    def __post_init__(self) -> None:
        self.threads = self.threads or self.ceiling
        self._window_start = self.clock()

    def after_step(self) -> None:
        now = self.clock()
        window = now - self._window_start
        if window < INTERVAL_S:
            return
        others = self.meter.others_cores()
        self._window_start = now
        if others is None:
            return
        self.seconds_at[self.threads] = self.seconds_at.get(self.threads, 0.0) + window
        free = self.meter.num_cpus - others
        target = next_thread_count(self.threads, self.ceiling, free)
        if target > self.threads:
            self._ups += 1
            if self._ups < UP_CONFIRM:
                return
        self._ups = 0
        if target != self.threads:
            log = logger.info if self.changes == 0 else logger.debug
            log("model threads on the CPU: %d -> %d (other processes used %.2f of this "
                "process's %d CPUs over the last %.1f s)", self.threads, target, others,
                self.meter.num_cpus, window)
            self.set_threads(target)
            self.threads = target
            self.changes += 1


def thread_governor(device_type: str, threads: int | None,
                    requested: int | None) -> ThreadGovernor | None:
    """The governor of a CPU engine started with `threads` model threads; None on a GPU, with
    an explicit `cpu_threads`, with one thread (nothing to give up), when switched off, or
    where the CPUs' busy time cannot be read (no /proc/stat)."""
    if device_type != "cpu" or threads is None or threads < 2 or requested is not None:
        return None
    if not envs.SHOAL_CPU_ADAPTIVE_THREADS.get():
        return None
    meter = CpuShareMeter.for_cpus(affinity_cpus())  # its baseline: now
    if meter is None:
        logger.info("model threads on the CPU stay at %d: this OS does not report the CPUs' "
                    "busy time", threads)
        return None
    return ThreadGovernor(ceiling=threads, meter=meter)
