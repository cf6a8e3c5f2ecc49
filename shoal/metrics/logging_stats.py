"""The periodic log line: throughput since the last line, queue sizes and KV usage (of the
whole server: the engines' latest reports merged under data parallelism)."""

from __future__ import annotations

import logging
import time

from shoal.core.types import SchedulerStats
from shoal.metrics.stats import IterationStats, merge_engine_stats

logger = logging.getLogger("shoal.metrics")


class LoggingStatLogger:
    def __init__(self) -> None:
        self._last_time = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._latest: dict[int, SchedulerStats] = {}
        self._stats = SchedulerStats()
        self._was_busy = False
        self._spec = [0, 0, 0]  # speculative decoding: drafts, draft tokens, accepted tokens

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats,
               engine: int = 0) -> None:
        if scheduler_stats is not None:
            self._latest[engine] = scheduler_stats
            self._stats = merge_engine_stats(list(self._latest.values()), scheduler_stats)
            self._prompt_tokens += scheduler_stats.num_prompt_tokens
            self._generation_tokens += scheduler_stats.num_generation_tokens
            s = scheduler_stats
            for i, v in enumerate((s.spec_num_drafts, s.spec_num_draft_tokens,
                                   s.spec_num_accepted_tokens)):
                self._spec[i] += v

    def format_line(self, now: float | None = None) -> str | None:
        """The line to log, or None when nothing happened since the last one."""
        now = time.monotonic() if now is None else now
        s = self._stats
        busy = s.num_running > 0 or s.num_waiting > 0
        active = busy or self._prompt_tokens > 0 or self._generation_tokens > 0
        # One more line after the engine goes idle, so the last figures show up as zero.
        if not active and not self._was_busy:
            self._last_time = now
            return None
        self._was_busy = active
        dt = max(now - self._last_time, 1e-9)
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        line = (f"Avg prompt throughput: {self._prompt_tokens / dt:.1f} tokens/s, "
                f"Avg generation throughput: {self._generation_tokens / dt:.1f} tokens/s, "
                f"Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
                f"KV cache usage: {s.kv_cache_usage * 100:.1f}%, "
                f"Prefix cache hit rate: {hit_rate * 100:.1f}%")
        drafts, drafted, accepted = self._spec
        if drafts:  # vLLM's figures: acceptance over draft tokens, tokens per verify step
            line += (f", Spec decode draft acceptance rate: {accepted / drafted * 100:.1f}%, "
                     f"Mean acceptance length: {1 + accepted / drafts:.2f}")
        self._last_time = now
        self._prompt_tokens = self._generation_tokens = 0
        self._spec = [0, 0, 0]
        return line

    def log(self) -> None:
        line = self.format_line()
        if line is not None:
            logger.info(line)
