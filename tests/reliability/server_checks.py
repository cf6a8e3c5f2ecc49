"""Reading a server's state back after abuse: its gauges on /metrics, settled."""

from __future__ import annotations

import time

import httpx

IDLE_GAUGES = ("shoal:num_requests_running", "shoal:num_requests_waiting",
               "shoal:kv_cache_usage_perc")


def gauges(base_url: str, names=IDLE_GAUGES) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        for name in names:
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def wait_idle(base_url: str, timeout_s: float = 20.0) -> dict[str, float]:
    """The idle gauges once all are 0 (aborts and the last steps take a moment to be
    reported), or their last values when the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        g = gauges(base_url)
        if (all(v == 0 for v in g.values()) and len(g) == len(IDLE_GAUGES)) \
                or time.monotonic() > deadline:
            return g
        time.sleep(0.1)
