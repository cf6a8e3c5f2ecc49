"""What the frontend measures per batch of engine outputs, and the interface of its consumers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from shoal.core.types import SchedulerStats


@dataclass
class FinishedRequestStats:
    """One finished sample: a request of n samples counts n times, as vLLM counts each of
    its n child requests. Times in seconds, measured in the frontend (arrival = when the
    frontend took the request; scheduled = arrival + the engine's queue time)."""

    finish_reason: str  # "stop" | "length" | "abort" | "error"
    e2e_latency: float  # seconds from arrival in the frontend to the sample's end
    num_prompt_tokens: int
    num_generation_tokens: int
    max_tokens: int | None = None  # the request's max_tokens (None: up to max_model_len)
    num_cached_tokens: int = 0
    queued_time: float = 0.0  # arrival -> first scheduled
    prefill_time: float = 0.0  # first scheduled -> first token
    decode_time: float = 0.0  # first token -> last token
    inference_time: float = 0.0  # first scheduled -> last token
    mean_time_per_output_token: float = 0.0  # decode time / (tokens after the first)


@dataclass
class FinishedParentStats:
    """One finished request as a whole, once all of its samples ended (vLLM's parent
    request)."""

    n: int
    max_num_generation_tokens: int  # of its longest sample


@dataclass
class IterationStats:
    """Latencies and token counts observed while handling one message of engine outputs
    (seconds)."""

    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    queue_times: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)  # samples
    finished_parents: list[FinishedParentStats] = field(default_factory=list)
    # Prompt tokens of the samples that got their first token (cached ones included), the
    # cached part of those, and tokens generated.
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_generation_tokens: int = 0


# Of SchedulerStats: cumulative since start-up, and the state now (summed over replicas).
CUMULATIVE_FIELDS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")
GAUGE_FIELDS = ("num_running", "num_waiting", "num_waiting_deferred", "num_state_blocks")


def merge_engine_stats(latest: list[SchedulerStats], step: SchedulerStats) -> SchedulerStats:
    """The whole server's state from every engine's latest report: gauges and cumulative
    counters summed, KV usage averaged; the step's own token and speculation counts."""
    if len(latest) == 1:
        return step
    fields: dict[str, Any] = {name: sum(getattr(s, name) for s in latest)
                              for name in (*GAUGE_FIELDS, *CUMULATIVE_FIELDS)}
    fields["kv_cache_usage"] = sum(s.kv_cache_usage for s in latest) / len(latest)
    return msgspec.structs.replace(step, **fields)


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats,
               engine: int = 0) -> None:
        """Called for every message of engine outputs; `engine` is the replica it came from
        (data parallelism), its stats that replica's own."""

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
