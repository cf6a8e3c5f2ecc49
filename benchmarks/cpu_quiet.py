"""Measuring on a shared CPU machine: wait until it is quiet, then record how quiet it stayed.

The helpers of w4_cpu_compare.py (CPU seconds of every process outside this run, read from
/proc), wrapped for the W6 scripts: `quiet()` waits for a quiet machine, `Quietness` measures
what other processes took during a measurement, so a disturbed run can be rerun."""

from __future__ import annotations

import os
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
