"""The offline engine's statistics (LLM(..., disable_log_stats=False)): vLLM's series in a
registry of its own, which LLM.get_metrics reads, and the periodic log line."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry

from shoal.metrics.cache_info import cache_config_info
from shoal.metrics.logging_stats import LoggingStatLogger
from shoal.metrics.prometheus import PrometheusStatLogger
from shoal.metrics.stats import IterationStats

LOG_INTERVAL_S = 10.0  # as the server's


class OfflineStats:
    def __init__(self, args: Any, limits: Any):
        self.registry = CollectorRegistry()
        self.prometheus = PrometheusStatLogger(
            args.model or "default", self.registry, prefixes=("vllm",),
            max_model_len=limits.max_model_len, cache_info=cache_config_info(limits, args))
        self.log_line = LoggingStatLogger()
        self._next_log = time.monotonic() + LOG_INTERVAL_S

    def record(self, scheduler_stats: Any, it: IterationStats) -> None:
        """One step's statistics (scheduler_stats None: a step without a report)."""
        self.prometheus.record(scheduler_stats, it)
        self.log_line.record(scheduler_stats, it)
        now = time.monotonic()
        if now >= self._next_log:
            self._next_log = now + LOG_INTERVAL_S
            self.log_line.log()
