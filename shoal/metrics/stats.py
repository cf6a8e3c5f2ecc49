"""What the frontend measures per batch of engine outputs, and the interface of its consumers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from shoal.engine.core_types import SchedulerStats


@dataclass
class FinishedRequestStats:
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    e2e_latency: float  # seconds from arrival in the frontend to the last output
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """Latencies observed while handling one message of engine outputs (seconds)."""

    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats) -> None:
        """Called for every message of engine outputs."""

    def log(self) -> None:
        """Called periodically (every 10 s by default)."""


class CumulativeDelta:
    """Turns a cumulative total from the engine into increments for a Prometheus counter.

    A total that goes down means the engine reset its counters (reset_stats), so the new value
    is itself the increment since then."""

    def __init__(self) -> None:
        self.last = 0

    def __call__(self, total: float) -> float:
        delta = total - self.last if total >= self.last else total
        self.last = total
        return delta
