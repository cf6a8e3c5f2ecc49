"""Metrics of `shoal serve --api-server-count N`: one /metrics over every process.

Each process (the supervisor and the N API processes) keeps its series in files of one
shared directory (prometheus_client's multiprocess mode); any API process's /metrics merges
them: counters and histograms summed over the processes, dead ones included (their requests
still happened), so one scrape shows the server's totals. The engine's own series (scheduler
state, step tokens, prefix cache, ...) are recorded by the supervisor alone, from the stats
the engine sends it each step: an API process records the series of its requests only
(latencies, finished requests, prompt tokens), so nothing is counted N times.

Every gauge is kept in "most recent" mode (the value last set by any process wins): the
engine gauges are set by the supervisor alone, the sleep state by whichever API process ran
/sleep or /wake_up. prometheus_client takes a gauge's mode from the family, so the mode and
its timestamps are supplied here, by the value class every process uses.

What else the API processes share (the Responses store, /load's count, run-time LoRA
adapters) is pool_state.py's.

`x-shoal-api-server: <k>` on every response and shoal:api_server_requests_total{api_server}
say which process served what (how evenly the kernel shared the connections out);
shoal:api_server_restarts_total{api_server}, the supervisor's, how often each was restarted.
A restarted process is a new pid: the dead one's files stay, so its index's counters go on
from where they were (never backwards), summed with the new process's.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, values
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

from shoal.core.types import SchedulerStats
from shoal.entrypoints.openai.pool_load import SharedServerLoad
from shoal.entrypoints.openai.pool_state import member
from shoal.metrics.stats import IterationStats

SOURCE = "shoal_src:"  # (shoal.metrics.prometheus: the one copy of each family)
IDENTITY_HEADER = b"x-shoal-api-server"


def enable_multiprocess_metrics(path: str) -> None:
    """Every metric this process creates from now on lives in `path` (call it before the
    first one is created)."""
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path
    base = values.MultiProcessValue()

    class StampedValue(base):  # type: ignore[misc,valid-type]
        """Gauges in "mostrecent" mode, every set() timestamped."""

        def __init__(self, typ: str, *args: Any, multiprocess_mode: str = "", **kw: Any):
            self._stamped = typ == "gauge"
            if self._stamped:
                multiprocess_mode = "mostrecent"
            super().__init__(typ, *args, multiprocess_mode=multiprocess_mode, **kw)

        def set(self, value: float, timestamp: float | None = None) -> None:
            if timestamp is None and self._stamped:
                timestamp = time.time()
            super().set(value, timestamp)

    values.ValueClass = StampedValue


def restart_counter(count: int) -> list[Any]:
    """The supervisor's shoal:api_server_restarts_total, one child per API process index,
    each written (at 0) now so that the series are there before any restart."""
    family = Counter("shoal:api_server_restarts", "Restarts of each API server process after "
                     "it died.", ["api_server"], registry=None)
    return [family.labels(str(k)) for k in range(count)]


class _MergedView:
    """The families of every process's files, `shoal_src:` ones under each prefix."""

    def __init__(self, path: str, prefixes: Sequence[str]):
        self.files = MultiProcessCollector(None, path=path)
        self.prefixes = [p + ":" for p in prefixes]

    def collect(self) -> Any:
        for family in self.files.collect():
            if not family.name.startswith(SOURCE):
                yield family
                continue
            for prefix in self.prefixes:
                rename = lambda name, p=prefix: p + name[len(SOURCE):]  # noqa: E731
                out = Metric(rename(family.name), family.documentation, family.type,
                             family.unit)
                out.samples = [s._replace(name=rename(s.name)) for s in family.samples]
                yield out


def merged_registry(path: str, prefixes: Sequence[str]) -> CollectorRegistry:
    """What an API process's /metrics serves."""
    registry = CollectorRegistry()
    registry.register(_MergedView(path, prefixes))
    return registry


class RequestSeriesOnly:
    """An API process's Prometheus logger: its requests' series; the engine's own are the
    supervisor's to record."""

    def __init__(self, inner: Any):
        self.inner = inner

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats,
               engine: int = 0) -> None:
        self.inner.record(None, iteration, engine)

    def set_sleep_level(self, level: int, engine: int = 0) -> None:
        self.inner.set_sleep_level(level, engine)

    def log(self) -> None:
        pass


class ApiServerIdentity:
    """Pure ASGI middleware: counts each HTTP request of API process `index` and names the
    process in a response header. The outermost of a pool member's app, it also brings the
    pool's /load (pool_load.py) when --enable-server-load-tracking is on."""

    def __init__(self, app: Any, index: int):
        pool = member()
        if pool is not None and pool.shared.load_tracking:
            app = SharedServerLoad(app, pool.shared, index)
        self.app = app
        self.header = (IDENTITY_HEADER, str(index).encode())
        self.requests = Counter("shoal:api_server_requests", "HTTP requests served by each "
                                "API server process.", ["api_server"],
                                registry=None).labels(str(index))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.requests.inc()

        async def named(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message,
                           "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, named)


@dataclass(frozen=True)
class PoolMember:
    """API process `index` of a server with several (`--api-server-count`)."""

    index: int
    metrics_dir: str
