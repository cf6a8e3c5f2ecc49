"""Serving metrics: Prometheus collectors and the periodic log line."""

from shoal.metrics.logging_stats import LoggingStatLogger
from shoal.metrics.prometheus import PrometheusStatLogger
from shoal.metrics.stats import (
    FinishedParentStats,
    FinishedRequestStats,
    IterationStats,
    StatLogger,
)

__all__ = [
    "FinishedParentStats",
    "FinishedRequestStats",
    "IterationStats",
    "LoggingStatLogger",
    "PrometheusStatLogger",
    "StatLogger",
]
