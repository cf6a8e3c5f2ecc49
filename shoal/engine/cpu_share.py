"""How much of this process's CPUs other processes used: the machine's busy time on those
CPUs (/proc/stat, one line per CPU), less this process's own CPU time, plus the time the
hypervisor gave to other guests (steal), over the window since the last reading.

One reading is a read of /proc/stat (tens of microseconds); the kernel counts in ticks of
10 ms, so a half-second window on 2 CPUs is exact to about 0.04 CPUs."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

PROC_STAT = Path("/proc/stat")


def read_cpu_busy(cpus: frozenset[int], text: str, tick: float) -> float:
    """Seconds the listed CPUs were busy since boot, steal included, from /proc/stat's text."""
    busy = 0
    for line in text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *vals = line.split()
        if int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal (guest is inside user)
        v = [int(x) for x in vals[:8]] + [0] * (8 - min(len(vals), 8))
        busy += v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
    return busy * tick


def own_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class CpuShareMeter:
    cpus: frozenset[int]
    read_stat: Callable[[], str] = PROC_STAT.read_text
    own_cpu: Callable[[], float] = own_cpu_seconds
    clock: Callable[[], float] = time.monotonic
    tick: float = 1.0 / os.sysconf("SC_CLK_TCK")
    _last: tuple[float, float, float] | None = None  # (wall, busy, own)

    @property
    def num_cpus(self) -> int:
        return len(self.cpus)

    @classmethod
    def for_cpus(cls, cpus: frozenset[int] | None) -> CpuShareMeter | None:
        """A meter of `cpus` with its baseline taken, or None where /proc/stat cannot be read
        (not Linux)."""
        if not cpus:
            return None
        meter = cls(cpus)
        try:
            meter.others_cores()
        except (OSError, ValueError):
            return None
        return meter

    def others_cores(self) -> float | None:
        """CPUs' worth of time others took on these CPUs since the last call (None at the
        first call, which only takes the baseline)."""
        now = (self.clock(), read_cpu_busy(self.cpus, self.read_stat(), self.tick),
               self.own_cpu())
        last, self._last = self._last, now
        if last is None or now[0] <= last[0]:
            return None
        others = (now[1] - last[1]) - (now[2] - last[2])
        return max(0.0, others / (now[0] - last[0]))
