"""A snapshot of a Prometheus registry as vLLM's `LLM.get_metrics()` returns it: one Metric
per series, a counter labelled by position (speculative decoding's accepted tokens per draft
position) folded into one Vector."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):
    value: int


@dataclass
class Vector(Metric):
    values: list[int]  # by position


@dataclass
class Gauge(Metric):
    value: float


@dataclass
class Histogram(Metric):
    count: int
    sum: float
    buckets: dict[str, int] = field(default_factory=dict)  # upper bound ("+Inf") -> count


def get_metrics_snapshot(registry: CollectorRegistry, prefix: str = "vllm:") -> list[Metric]:
    """The registry's families named `prefix`*, as Metric objects."""
    out: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith(prefix):
            continue
        if family.type == "counter":
            out += _counters(family)
        elif family.type == "gauge":
            out += [Gauge(family.name, dict(s.labels), s.value) for s in family.samples]
        elif family.type == "histogram":
            out += _histograms(family)
    return out


def _counters(family: Any) -> list[Metric]:
    totals = [s for s in family.samples if s.name.endswith("_total")]
    if not any("position" in s.labels for s in totals):
        return [Counter(family.name, dict(s.labels), int(s.value)) for s in totals]
    vectors: dict[tuple, dict[int, int]] = {}
    for s in totals:
        rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "position"))
        vectors.setdefault(rest, {})[int(s.labels["position"])] = int(s.value)
    return [Vector(family.name, dict(rest), [by_pos.get(i, 0) for i in range(max(by_pos) + 1)])
            for rest, by_pos in vectors.items()]


def _histograms(family: Any) -> list[Metric]:
    series: dict[tuple, Histogram] = {}
    for s in family.samples:
        rest = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
        h = series.setdefault(rest, Histogram(family.name, dict(rest), 0, 0.0))
        if s.name.endswith("_bucket"):
            h.buckets[s.labels["le"]] = int(s.value)
        elif s.name.endswith("_count"):
            h.count = int(s.value)
        elif s.name.endswith("_sum"):
            h.sum = s.value
    return list(series.values())
