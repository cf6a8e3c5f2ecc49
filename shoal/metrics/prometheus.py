"""Prometheus collectors with vLLM's metric names under the `shoal:` prefix.

Each logger owns its collectors in the registry it is given (one per app), so tests can build
several servers in one process without "duplicated timeseries" errors from the global one.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shoal.engine.core_types import SchedulerStats
from shoal.metrics.stats import CumulativeDelta, IterationStats

PREFIX = "shoal:"
# Latency buckets in seconds, from a fast GPU decode step up to a very long queue on a CPU.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
               0.75, 1.0, 2.0, 5.0, 10.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0)


TIER_COUNTERS = {
    "queries": "Blocks looked up in a KV tier.",
    "hits": "Blocks found in a KV tier.",
    "bytes_loaded": "Bytes loaded from a KV tier.",
    "load_seconds": "Seconds spent loading from a KV tier.",
    "bytes_stored": "Bytes stored into a KV tier.",
    "store_seconds": "Seconds spent storing into a KV tier.",
    "evictions": "Blocks evicted from a KV tier.",
    "damaged": "Blocks found damaged in a KV tier, dropped and recomputed.",
}


class PrometheusStatLogger:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.model_name = model_name
        self.running = gauge("num_requests_running", "Requests being computed in the batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Preemptions by the scheduler.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens computed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Requests finished, by reason.",
                                       ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to the first token.",
                              TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last output.",
                             REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Arrival to first scheduling.", REQUEST_BUCKETS)
        self._queries = CumulativeDelta()
        self._hits = CumulativeDelta()
        self._preempt = CumulativeDelta()
        # Secondary KV tiers, labelled by tier ("cpu", "disk").
        self.tier_usage = Gauge(PREFIX + "kv_offload_usage_perc",
                                "Bytes used over capacity of a KV tier.",
                                labels + ["tier"], registry=r)
        self.tier_counters = {
            field: counter("kv_offload_" + field, doc, ("tier",))
            for field, doc in TIER_COUNTERS.items()
        }
        self._tier_deltas: dict[tuple[str, str], CumulativeDelta] = {}
        # Touch the labelled children so every series shows up (as 0) before any traffic.
        for m in (self.running, self.waiting, self.kv_usage, self.prefix_queries,
                  self.prefix_hits, self.preemptions, self.prompt_tokens,
                  self.generation_tokens, self.ttft, self.itl, self.e2e, self.queue_time):
            m.labels(model_name)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(model_name, reason)
        # Observed once per streamed token: look the labelled children up once.
        self._ttft_child = self.ttft.labels(model_name)
        self._itl_child = self.itl.labels(model_name)

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats) -> None:
        name = self.model_name
        s = scheduler_stats
        if s is not None:
            self.running.labels(name).set(s.num_running)
            self.waiting.labels(name).set(s.num_waiting)
            self.kv_usage.labels(name).set(s.kv_cache_usage)
            self.prefix_queries.labels(name).inc(self._queries(s.prefix_cache_queries))
            self.prefix_hits.labels(name).inc(self._hits(s.prefix_cache_hits))
            self.preemptions.labels(name).inc(self._preempt(s.num_preemptions))
            self.prompt_tokens.labels(name).inc(s.num_prompt_tokens)
            self.generation_tokens.labels(name).inc(s.num_generation_tokens)
            for tier, figures in (s.kv_tiers or {}).items():
                self._record_tier(tier, figures)
        for v in iteration.time_to_first_tokens:
            self._ttft_child.observe(v)
        for v in iteration.inter_token_latencies:
            self._itl_child.observe(v)
        for v in iteration.queue_times:
            self.queue_time.labels(name).observe(v)
        for f in iteration.finished:
            self.e2e.labels(name).observe(f.e2e_latency)
            self.request_success.labels(name, f.finish_reason).inc()

    def _record_tier(self, tier: str, figures: dict[str, float]) -> None:
        name = self.model_name
        self.tier_usage.labels(name, tier).set(figures.get("usage", 0.0))
        for field, metric in self.tier_counters.items():
            delta = self._tier_deltas.setdefault((tier, field), CumulativeDelta())
            metric.labels(name, tier).inc(delta(figures.get(field, 0)))

    def log(self) -> None:
        pass  # scraped, not logged
