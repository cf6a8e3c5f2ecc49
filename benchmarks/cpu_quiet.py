"""Measuring on a shared CPU machine: wait until it is quiet, then record how quiet it stayed.

`OtherLoad` counts the CPU seconds of every process outside this run (read from /proc, this
process's descendants left out), so a disturbed measurement can be rerun; `wait_quiet()`
waits for a quiet machine.

`MachineLoad` counts what the per-process table misses (processes that start and end inside
the window, such as a neighbour's test run): the machine's busy time from /proc/stat less
this process's own CPU time (and its waited-for children's)."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def _proc_table() -> dict[int, tuple[int, float]]:
    """pid -> (parent pid, CPU seconds so far), for every process."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2:].split()
        table[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK)
    return table


def _ours(table: dict[int, tuple[int, float]]) -> set[int]:
    mine, changed = {os.getpid()}, True
    while changed:
        changed = False
        for pid, (ppid, _) in table.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                changed = True
    return mine


class OtherLoad:
    """CPU seconds that processes outside this run (and their children) used meanwhile."""

    def __init__(self) -> None:
        self.before = _proc_table()
        self.t0 = time.monotonic()

    def seconds(self) -> tuple[float, float]:
        after = _proc_table()
        ours = _ours(after) | _ours(self.before)
        other = sum(cpu - (self.before[pid][1] if pid in self.before else 0.0)
                    for pid, (_, cpu) in after.items() if pid not in ours and pid > 2)
        return max(other, 0.0), time.monotonic() - self.t0


def wait_quiet(max_cores: float = 0.1, window: float = 5.0, limit: float = 1800.0) -> float:
    """Waits until other processes use under `max_cores` cores over `window` seconds (at most
    `limit` seconds); returns the seconds waited."""
    start = time.monotonic()
    while True:
        load = OtherLoad()
        time.sleep(window)
        other, wall = load.seconds()
        if other / wall < max_cores or time.monotonic() - start > limit:
            return time.monotonic() - start
        print(f"   waiting for a quiet machine ({other / wall:.2f} cores busy elsewhere)",
              flush=True)


def _machine_busy_s() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, steal seconds) since boot."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (vals + [0] * 8)[:8]
    return (user + nice + system + irq + softirq) / TICK, steal / TICK


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

