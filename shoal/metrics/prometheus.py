"""Prometheus collectors with vLLM's metric families, under `vllm:` and/or `shoal:`.

Every family vLLM 0.27/0.28 exports that shoal can compute honestly is here with vLLM's name,
type, labels and buckets, so a dashboard built for vLLM works unchanged on the `vllm:` names;
the same families are exported under `shoal:` (the server's --metrics-prefixes picks). Families
only shoal has (the KV offload tiers) are exported under `shoal:` alone.

Each logger owns its collectors in the registry it is given (one per app), so tests can build
several servers in one process without "duplicated timeseries" errors from the global one.
Labelled children are looked up once, at start: some series are observed once per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from shoal.engine.core_types import SchedulerStats
from shoal.metrics.stats import CumulativeDelta, IterationStats

PREFIXES = ("vllm", "shoal")
_SOURCE = "shoal_src:"  # the one copy of each family, exported under every prefix by a view
LABELS = ["model_name"]
FINISH_REASONS = ("stop", "length", "abort", "error")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)

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


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return out
            out.append(value)
        exponent += 1


class _PrefixedView:
    """Every family of `source` (named `shoal_src:...`) exported as `<prefix>:...`: a series is
    observed once however many prefixes export it (some are observed once per token)."""

    def __init__(self, source: CollectorRegistry, prefix: str):
        self.source = source
        self.prefix = prefix + ":"

    def _rename(self, name: str) -> str:
        return self.prefix + name[len(_SOURCE):]

    def collect(self) -> Any:
        for family in self.source.collect():
            out = Metric(self._rename(family.name), family.documentation, family.type,
                         family.unit)
            out.samples = [s._replace(name=self._rename(s.name)) for s in family.samples]
            yield out


class PrometheusStatLogger:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, *,
                 prefixes: Sequence[str] = PREFIXES, max_model_len: int = 2048,
                 cache_info: dict[str, str] | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.prefixes = list(prefixes)
        self._source = CollectorRegistry(auto_describe=True)
        for prefix in self.prefixes:
            self.registry.register(_PrefixedView(self._source, prefix))
        self._engine_families()
        self._request_families(buckets_1_2_5(max_model_len))
        if cache_info:
            info = self._family(Gauge, "cache_config_info", "Information of the LLMEngine "
                                "CacheConfig", list(cache_info), model_label=False)
            info.labels(*cache_info.values()).set(1)
        self._queries = CumulativeDelta()
        self._hits = CumulativeDelta()
        self._preempt = CumulativeDelta()
        self._tiers = "shoal" in self.prefixes
        if self._tiers:  # shoal's own families: the shoal: prefix only
            self.tier_usage = self._family(Gauge, "kv_offload_usage_perc", "Bytes used over "
                                           "capacity of a KV tier.", ["tier"], only="shoal")
            self.tier_counters = {
                field: self._family(Counter, "kv_offload_" + field, doc, ["tier"],
                                    only="shoal")
                for field, doc in TIER_COUNTERS.items()}
        self._tier_children: dict[tuple[str, str], tuple[Any, CumulativeDelta]] = {}

    def _gauge(self, metric: str, doc: str) -> Any:
        return self._family(Gauge, metric, doc).labels(self.model_name)

    def _counter(self, metric: str, doc: str) -> Any:
        return self._family(Counter, metric, doc).labels(self.model_name)

    def _histogram(self, metric: str, doc: str, buckets: Sequence[float]) -> Any:
        return self._family(Histogram, metric, doc, buckets=buckets).labels(self.model_name)

    def _engine_families(self) -> None:
        """Scheduler state and token counters."""
        name, gauge, counter = self.model_name, self._gauge, self._counter
        self.running = gauge("num_requests_running", "Number of requests in model execution "
                                                     "batches.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be "
                                                     "processed.")
        by_reason = self._family(Gauge, "num_requests_waiting_by_reason",
                                 "Number of waiting requests by reason: 'capacity' = waiting "
                                 "for scheduling capacity; 'deferred' = deferred by transient "
                                 "constraints (a KV load from a slower tier).", ["reason"])
        self.waiting_capacity = by_reason.labels(name, "capacity")
        self.waiting_deferred = by_reason.labels(name, "deferred")
        sleep = self._family(Gauge, "engine_sleep_state", "Engine sleep state; shoal's engine "
                             "does not sleep, so awake is always 1.", ["sleep_state"])
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            sleep.labels(name, state).set(value)
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent "
                                                     "usage.")
        self.prefix_queries = counter("prefix_cache_queries", "Prefix cache queries, in terms "
                                                              "of number of queried tokens.")
        self.prefix_hits = counter("prefix_cache_hits", "Prefix cache hits, in terms of number "
                                                        "of cached tokens.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemption from "
                                                      "the engine.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        by_source = self._family(Counter, "prompt_tokens_by_source",
                                 "Number of prompt tokens by source.", ["source"])
        self.prompt_computed = by_source.labels(name, "local_compute")
        self.prompt_cache_hit = by_source.labels(name, "local_cache_hit")
        by_source.labels(name, "external_kv_transfer")  # shoal has no external KV source
        self.prompt_cached = counter("prompt_tokens_cached", "Number of cached prompt tokens "
                                                             "(local + external).")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens "
                                                              "processed.")
        success = self._family(Counter, "request_success", "Count of successfully processed "
                                                           "requests.", ["finished_reason"])
        self._success_family = success
        self.success = {r: success.labels(name, r) for r in FINISH_REASONS}
        self.iteration_tokens = self._histogram("iteration_tokens_total", "Histogram of number "
                                                "of tokens per engine_step.", ITERATION_BUCKETS)
        self.spec_drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft "
                                                                         "tokens.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Number of accepted "
                                                                        "tokens.")
        self._spec_per_pos_family = self._family(
            Counter, "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft "
            "position.", ["position"])
        self._spec_per_pos: list[Any] = []

    def _request_families(self, tokens: list[int]) -> None:
        """Per-request histograms (sizes, parameters, latencies by phase)."""
        histogram = self._histogram
        self.req_prompt_tokens = histogram("request_prompt_tokens", "Number of prefill tokens "
                                                                    "processed.", tokens)
        self.req_generation_tokens = histogram("request_generation_tokens", "Number of "
                                               "generation tokens processed.", tokens)
        self.req_max_generation = histogram("request_max_num_generation_tokens", "Histogram of "
                                            "maximum number of requested generation tokens.",
                                            tokens)
        self.req_n = histogram("request_params_n", "Histogram of the n request parameter.",
                               N_BUCKETS)
        self.req_max_tokens = histogram("request_params_max_tokens", "Histogram of the "
                                        "max_tokens request parameter.", tokens)
        self.ttft = histogram("time_to_first_token_seconds", "Histogram of time to first token "
                                                             "in seconds.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Histogram of inter-token latency "
                                                            "in seconds.", ITL_BUCKETS)
        self.tpot = histogram("request_time_per_output_token_seconds", "Histogram of "
                              "time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Histogram of e2e request latency "
                                                            "in seconds.", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Histogram of time spent in "
                                    "WAITING phase for request.", REQUEST_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds", "Histogram of time "
                                        "spent in RUNNING phase for request.", REQUEST_BUCKETS)
        self.prefill_time = histogram("request_prefill_time_seconds", "Histogram of time spent "
                                      "in PREFILL phase for request.", REQUEST_BUCKETS)
        self.decode_time = histogram("request_decode_time_seconds", "Histogram of time spent "
                                     "in DECODE phase for request.", REQUEST_BUCKETS)
        self.prefill_kv_computed = histogram("request_prefill_kv_computed_tokens", "Histogram "
                                             "of new KV tokens computed during prefill "
                                             "(excluding cached tokens).", tokens)

    def _family(self, cls: Any, metric: str, doc: str, extra: Sequence[str] = (), *,
                model_label: bool = True, only: str | None = None, **kw: Any) -> Any:
        """One collector for a family: in the source registry (exported under every prefix),
        or straight in the served registry under `only`'s prefix for shoal's own families."""
        labels = (LABELS if model_label else []) + list(extra)
        if only is not None:
            return cls(f"{only}:{metric}", doc, labels, registry=self.registry, **kw)
        return cls(_SOURCE + metric, doc, labels, registry=self._source, **kw)

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats) -> None:
        s = scheduler_stats
        if s is not None:
            self.running.set(s.num_running)
            self.waiting.set(s.num_waiting)
            deferred = min(s.num_waiting_deferred, s.num_waiting)
            self.waiting_capacity.set(s.num_waiting - deferred)
            self.waiting_deferred.set(deferred)
            self.kv_usage.set(s.kv_cache_usage)
            self.prefix_queries.inc(self._queries(s.prefix_cache_queries))
            self.prefix_hits.inc(self._hits(s.prefix_cache_hits))
            self.preemptions.inc(self._preempt(s.num_preemptions))
            self.generation_tokens.inc(s.num_generation_tokens)
            step_tokens = s.num_prompt_tokens + s.num_generation_tokens
            if step_tokens:
                self.iteration_tokens.observe(step_tokens)
            if s.spec_num_drafts:
                self._record_spec(s)
            if self._tiers:
                for tier, figures in (s.kv_tiers or {}).items():
                    self._record_tier(tier, figures)
        it = iteration
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
            self.prompt_cached.inc(it.num_cached_prompt_tokens)
            self.prompt_cache_hit.inc(it.num_cached_prompt_tokens)
            self.prompt_computed.inc(it.num_prompt_tokens - it.num_cached_prompt_tokens)
        for v in it.time_to_first_tokens:
            self.ttft.observe(v)
        for v in it.inter_token_latencies:
            self.itl.observe(v)
        for f in it.finished:
            child = self.success.get(f.finish_reason)
            if child is None:  # a reason beyond vLLM's four: its own series
                child = self.success[f.finish_reason] = self._success_family.labels(
                    self.model_name, f.finish_reason)
            child.inc()
            self.e2e.observe(f.e2e_latency)
            self.queue_time.observe(f.queued_time)
            self.prefill_time.observe(f.prefill_time)
            self.decode_time.observe(f.decode_time)
            self.inference_time.observe(f.inference_time)
            self.tpot.observe(f.mean_time_per_output_token)
            self.req_prompt_tokens.observe(f.num_prompt_tokens)
            self.req_generation_tokens.observe(f.num_generation_tokens)
            self.req_max_generation.observe(f.max_num_generation_tokens)
            self.prefill_kv_computed.observe(max(f.num_prompt_tokens - f.num_cached_tokens, 0))
            self.req_n.observe(f.n)
            if f.max_tokens:
                self.req_max_tokens.observe(f.max_tokens)

    def _record_spec(self, s: SchedulerStats) -> None:
        self.spec_drafts.inc(s.spec_num_drafts)
        self.spec_draft_tokens.inc(s.spec_num_draft_tokens)
        self.spec_accepted.inc(s.spec_num_accepted_tokens)
        per_pos = s.spec_num_accepted_tokens_per_pos or []
        while len(self._spec_per_pos) < len(per_pos):
            self._spec_per_pos.append(self._spec_per_pos_family.labels(
                self.model_name, str(len(self._spec_per_pos))))
        for child, n in zip(self._spec_per_pos, per_pos):
            child.inc(n)

    def _record_tier(self, tier: str, figures: dict[str, float]) -> None:
        self.tier_usage.labels(self.model_name, tier).set(figures.get("usage", 0.0))
        for field, family in self.tier_counters.items():
            entry = self._tier_children.get((tier, field))
            if entry is None:
                entry = (family.labels(self.model_name, tier), CumulativeDelta())
                self._tier_children[(tier, field)] = entry
            child, delta = entry
            child.inc(delta(figures.get(field, 0)))

    def log(self) -> None:
        pass  # scraped, not logged
