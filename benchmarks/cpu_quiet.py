"""Measuring on a shared CPU machine: wait until it is quiet, then record how quiet it stayed.

The helpers of w4_cpu_compare.py (CPU seconds of every process outside this run, read from
/proc), wrapped for the W6 scripts: `quiet()` waits for a quiet machine, `Quietness` measures
what other processes took during a measurement, so a disturbed run can be rerun.

`MachineLoad` counts what the per-process table misses (processes that start and end inside
the window, such as a neighbour's test run): the machine's busy time from /proc/stat less
this process's own CPU time (and its waited-for children's)."""

from __future__ import annotations

import os
import resource
import time
from typing import Any

from w4_cpu_compare import OtherLoad, wait_quiet


def quiet(max_cores: float = 0.1, window: float = 5.0, limit: float = 1800.0) -> float:
    """Waits until other processes use under `max_cores` cores; returns the seconds waited."""
    return wait_quiet(max_cores=max_cores, window=window, limit=limit)


class Quietness:
    """Other processes' CPU use over a measurement (cores, averaged over its wall time)."""

    def __init__(self) -> None:
        self.load = OtherLoad()
        self.loadavg_before = os.getloadavg()[0]

    def result(self) -> dict[str, Any]:
        other, wall = self.load.seconds()
        return {"other_processes_cores": round(other / max(wall, 1e-9), 3),
                "wall_s": round(wall, 2), "loadavg_1m_before": self.loadavg_before,
                "loadavg_1m_after": os.getloadavg()[0]}


def measure_quietly(fn: Any, *, max_other_cores: float = 0.15, attempts: int = 3
                    ) -> tuple[Any, dict[str, Any]]:
    """Runs fn() on a quiet machine; reruns it (up to `attempts` times) while other processes
    took more than `max_other_cores` during it. Returns fn's result and the quietness."""
    for attempt in range(1, attempts + 1):
        waited = quiet()
        q = Quietness()
        out = fn()
        info = {**q.result(), "attempt": attempt, "waited_for_quiet_s": round(waited, 1)}
        if info["other_processes_cores"] <= max_other_cores:
            return out, info
        print(f"   disturbed ({info['other_processes_cores']:.2f} cores elsewhere): rerun",
              flush=True)
        time.sleep(1)
    return out, {**info, "disturbed": True}


def _machine_busy_s() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, steal seconds) since boot."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (vals + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / tick, steal / tick


def _own_cpu_s() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class MachineLoad:
    """Cores used by everything but this process over a window, and the hypervisor's steal."""

    def __init__(self) -> None:
        self.busy0, self.steal0 = _machine_busy_s()
        self.own0 = _own_cpu_s()
        self.t0 = time.monotonic()

    def result(self) -> dict[str, float]:
        busy, steal = _machine_busy_s()
        wall = max(time.monotonic() - self.t0, 1e-9)
        other = (busy - self.busy0) - (_own_cpu_s() - self.own0)
        return {"other_cores": round(max(other, 0.0) / wall, 3),
                "steal_cores": round((steal - self.steal0) / wall, 3),
                "loadavg_1m": round(os.getloadavg()[0], 2)}

