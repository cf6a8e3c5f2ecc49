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

from shoal.core.types import SchedulerStats
from shoal.metrics.stats import CumulativeDelta, IterationStats

PREFIXES = ("vllm", "shoal")
_SOURCE = "shoal_src:"  # the one copy of each family, exported under every prefix by a view
LABELS = ["model_name", "engine"]
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


class _EngineSeries:
    """One engine's labelled children, looked up once (some are observed once per token), and
    its counters' last cumulative totals."""

    def __init__(self, logger: PrometheusStatLogger, engine: int):
        name, label = logger.model_name, str(engine)
        self.labels = (name, label)
        for attr, family in logger.families.items():
            setattr(self, attr, family.labels(name, label))
        f = logger.extra_families
        self.waiting_capacity = f["waiting_by_reason"].labels(name, label, "capacity")
        self.waiting_deferred = f["waiting_by_reason"].labels(name, label, "deferred")
        for state, value in (("awake", 1), ("weights_offloaded", 0), ("discard_all", 0)):
            f["sleep_state"].labels(name, label, state).set(value)
        self.prompt_computed = f["prompt_by_source"].labels(name, label, "local_compute")
        self.prompt_cache_hit = f["prompt_by_source"].labels(name, label, "local_cache_hit")
        f["prompt_by_source"].labels(name, label, "external_kv_transfer")  # none in shoal
        self.success = {r: f["success"].labels(name, label, r) for r in FINISH_REASONS}
        self.spec_per_pos: list[Any] = []
        self.queries, self.hits, self.preempt = CumulativeDelta(), CumulativeDelta(), \
            CumulativeDelta()
        self.mm_queries_total, self.mm_hits_total = CumulativeDelta(), CumulativeDelta()
        self.tiers: dict[tuple[str, str], tuple[Any, CumulativeDelta]] = {}


class PrometheusStatLogger:
    """Every series is labelled with the model and the engine (replica) it comes from, as
    vLLM's: engine "0" alone without data parallelism."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None, *,
                 prefixes: Sequence[str] = PREFIXES, max_model_len: int = 2048,
                 cache_info: dict[str, str] | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        self.prefixes = list(prefixes)
        self._source = CollectorRegistry(auto_describe=True)
        for prefix in self.prefixes:
            self.registry.register(_PrefixedView(self._source, prefix))
        # attribute on _EngineSeries -> family labelled (model_name, engine) only
        self.families: dict[str, Any] = {}
        self.extra_families: dict[str, Any] = {}  # the families with more labels
        self._engine_families()
        self._request_families(buckets_1_2_5(max_model_len))
        # vLLM's LoRA gauge: labels only (the adapters of running and waiting requests), the
        # time of the last report as its value; the old label set is dropped at each report
        self.lora_info = self._family(Gauge, "lora_requests_info", "Running stats on lora "
                                      "requests.", ["max_lora", "waiting_lora_adapters",
                                                    "running_lora_adapters"], model_label=False)
        if cache_info:
            info = self._family(Gauge, "cache_config_info", "Information of the LLMEngine "
                                "CacheConfig", list(cache_info), model_label=False)
            info.labels(*cache_info.values()).set(1)
        self._tiers = "shoal" in self.prefixes
        if self._tiers:  # shoal's own families: the shoal: prefix only
            self.tier_usage = self._family(Gauge, "kv_offload_usage_perc", "Bytes used over "
                                           "capacity of a KV tier.", ["tier"], only="shoal")
            self.tier_counters = {
                field: self._family(Counter, "kv_offload_" + field, doc, ["tier"],
                                    only="shoal")
                for field, doc in TIER_COUNTERS.items()}
        self._series: dict[int, _EngineSeries] = {}
        self.series(0)  # engine 0's series exist (at zero) before its first step

    def series(self, engine: int) -> _EngineSeries:
        s = self._series.get(engine)
        if s is None:
            s = self._series[engine] = _EngineSeries(self, engine)
        return s

    def _gauge(self, attr: str, metric: str, doc: str) -> None:
        self.families[attr] = self._family(Gauge, metric, doc)

    def _counter(self, attr: str, metric: str, doc: str) -> None:
        self.families[attr] = self._family(Counter, metric, doc)

    def _histogram(self, attr: str, metric: str, doc: str, buckets: Sequence[float]) -> None:
        self.families[attr] = self._family(Histogram, metric, doc, buckets=buckets)

    def _engine_families(self) -> None:
        """Scheduler state and token counters."""
        gauge, counter, extra = self._gauge, self._counter, self.extra_families
        gauge("running", "num_requests_running", "Number of requests in model execution "
                                                 "batches.")
        gauge("waiting", "num_requests_waiting", "Number of requests waiting to be processed.")
        extra["waiting_by_reason"] = self._family(
            Gauge, "num_requests_waiting_by_reason", "Number of waiting requests by reason: "
            "'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient "
            "constraints (a KV load from a slower tier).", ["reason"])
        extra["sleep_state"] = self._family(
            Gauge, "engine_sleep_state", "Engine sleep state: 1 on the current one of awake, "
            "weights_offloaded (sleep level 1) and discard_all (level 2).", ["sleep_state"])
        gauge("kv_usage", "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        gauge("state_blocks", "linear_state_blocks", "KV blocks holding linear-attention "
              "recurrent states (a block holds one state of each layer of a state group).")
        gauge("state_bytes", "linear_state_bytes_per_request", "Bytes of a request's "
              "linear-attention recurrent states, all layers (0: no linear layers).")
        counter("prefix_queries", "prefix_cache_queries", "Prefix cache queries, in terms of "
                                                          "number of queried tokens.")
        counter("prefix_hits", "prefix_cache_hits", "Prefix cache hits, in terms of number of "
                                                    "cached tokens.")
        counter("mm_queries", "mm_cache_queries", "Multi-modal cache queries, in terms of "
                                                  "number of queried items.")
        counter("mm_hits", "mm_cache_hits", "Multi-modal cache hits, in terms of number of "
                                            "cached items.")
        counter("preemptions", "num_preemptions", "Cumulative number of preemption from the "
                                                  "engine.")
        counter("prompt_tokens", "prompt_tokens", "Number of prefill tokens processed.")
        extra["prompt_by_source"] = self._family(
            Counter, "prompt_tokens_by_source", "Number of prompt tokens by source.", ["source"])
        counter("prompt_cached", "prompt_tokens_cached", "Number of cached prompt tokens "
                                                         "(local + external).")
        counter("generation_tokens", "generation_tokens", "Number of generation tokens "
                                                          "processed.")
        extra["success"] = self._family(Counter, "request_success", "Count of successfully "
                                        "processed requests.", ["finished_reason"])
        self._histogram("iteration_tokens", "iteration_tokens_total", "Histogram of number of "
                        "tokens per engine_step.", ITERATION_BUCKETS)
        counter("spec_drafts", "spec_decode_num_drafts", "Number of spec decoding drafts.")
        counter("spec_draft_tokens", "spec_decode_num_draft_tokens", "Number of draft tokens.")
        counter("spec_accepted", "spec_decode_num_accepted_tokens", "Number of accepted "
                                                                    "tokens.")
        extra["spec_per_pos"] = self._family(
            Counter, "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft "
            "position.", ["position"])

    def _request_families(self, tokens: list[int]) -> None:
        """Per-request histograms (sizes, parameters, latencies by phase)."""
        histogram = self._histogram
        histogram("req_prompt_tokens", "request_prompt_tokens", "Number of prefill tokens "
                                                                "processed.", tokens)
        histogram("req_generation_tokens", "request_generation_tokens", "Number of generation "
                                                                        "tokens processed.",
                  tokens)
        histogram("req_max_generation", "request_max_num_generation_tokens", "Histogram of "
                  "maximum number of requested generation tokens.", tokens)
        histogram("req_n", "request_params_n", "Histogram of the n request parameter.",
                  N_BUCKETS)
        histogram("req_max_tokens", "request_params_max_tokens", "Histogram of the max_tokens "
                                                                 "request parameter.", tokens)
        histogram("ttft", "time_to_first_token_seconds", "Histogram of time to first token in "
                                                         "seconds.", TTFT_BUCKETS)
        histogram("itl", "inter_token_latency_seconds", "Histogram of inter-token latency in "
                                                        "seconds.", ITL_BUCKETS)
        histogram("tpot", "request_time_per_output_token_seconds", "Histogram of "
                  "time_per_output_token_seconds per request.", ITL_BUCKETS)
        histogram("e2e", "e2e_request_latency_seconds", "Histogram of e2e request latency in "
                                                        "seconds.", REQUEST_BUCKETS)
        histogram("queue_time", "request_queue_time_seconds", "Histogram of time spent in "
                  "WAITING phase for request.", REQUEST_BUCKETS)
        histogram("inference_time", "request_inference_time_seconds", "Histogram of time spent "
                  "in RUNNING phase for request.", REQUEST_BUCKETS)
        histogram("prefill_time", "request_prefill_time_seconds", "Histogram of time spent in "
                  "PREFILL phase for request.", REQUEST_BUCKETS)
        histogram("decode_time", "request_decode_time_seconds", "Histogram of time spent in "
                  "DECODE phase for request.", REQUEST_BUCKETS)
        histogram("prefill_kv_computed", "request_prefill_kv_computed_tokens", "Histogram of "
                  "new KV tokens computed during prefill (excluding cached tokens).", tokens)

    def _family(self, cls: Any, metric: str, doc: str, extra: Sequence[str] = (), *,
                model_label: bool = True, only: str | None = None, **kw: Any) -> Any:
        """One collector for a family: in the source registry (exported under every prefix),
        or straight in the served registry under `only`'s prefix for shoal's own families."""
        labels = (LABELS if model_label else []) + list(extra)
        if only is not None:
            return cls(f"{only}:{metric}", doc, labels, registry=self.registry, **kw)
        return cls(_SOURCE + metric, doc, labels, registry=self._source, **kw)

    def set_sleep_level(self, level: int, engine: int = 0) -> None:
        """0 awake, 1 weights offloaded, 2 everything discarded (the server's /sleep)."""
        e = self.series(engine)
        for i, state in enumerate(("awake", "weights_offloaded", "discard_all")):
            self.extra_families["sleep_state"].labels(*e.labels, state).set(int(i == level))

    def record(self, scheduler_stats: SchedulerStats | None, iteration: IterationStats,
               engine: int = 0) -> None:
        e = self.series(engine)
        s = scheduler_stats
        if s is not None:
            e.running.set(s.num_running)
            e.waiting.set(s.num_waiting)
            deferred = min(s.num_waiting_deferred, s.num_waiting)
            e.waiting_capacity.set(s.num_waiting - deferred)
            e.waiting_deferred.set(deferred)
            e.kv_usage.set(s.kv_cache_usage)
            e.state_blocks.set(s.num_state_blocks)
            e.state_bytes.set(s.state_bytes_per_request)
            e.prefix_queries.inc(e.queries(s.prefix_cache_queries))
            e.prefix_hits.inc(e.hits(s.prefix_cache_hits))
            e.preemptions.inc(e.preempt(s.num_preemptions))
            # an image looked up in the encoder cache: a hit, or a miss that was encoded
            e.mm_queries.inc(e.mm_queries_total(s.mm_items_encoded + s.mm_cache_hits))
            e.mm_hits.inc(e.mm_hits_total(s.mm_cache_hits))
            e.generation_tokens.inc(s.num_generation_tokens)
            step_tokens = s.num_prompt_tokens + s.num_generation_tokens
            if step_tokens:
                e.iteration_tokens.observe(step_tokens)
            if s.spec_num_drafts:
                self._record_spec(e, s)
            if s.running_loras is not None:
                self.lora_info.clear()
                self.lora_info.labels(str(s.max_loras), ",".join(s.waiting_loras or ()),
                                      ",".join(s.running_loras)).set_to_current_time()
            if self._tiers:
                for tier, figures in (s.kv_tiers or {}).items():
                    self._record_tier(e, tier, figures)
        it = iteration
        if it.num_prompt_tokens:
            e.prompt_tokens.inc(it.num_prompt_tokens)
            e.prompt_cached.inc(it.num_cached_prompt_tokens)
            e.prompt_cache_hit.inc(it.num_cached_prompt_tokens)
            e.prompt_computed.inc(it.num_prompt_tokens - it.num_cached_prompt_tokens)
        for v in it.time_to_first_tokens:
            e.ttft.observe(v)
        for v in it.inter_token_latencies:
            e.itl.observe(v)
        for f in it.finished:
            child = e.success.get(f.finish_reason)
            if child is None:  # a reason beyond vLLM's four: its own series
                child = e.success[f.finish_reason] = self.extra_families["success"].labels(
                    *e.labels, f.finish_reason)
            child.inc()
            e.e2e.observe(f.e2e_latency)
            e.queue_time.observe(f.queued_time)
            e.prefill_time.observe(f.prefill_time)
            e.decode_time.observe(f.decode_time)
            e.inference_time.observe(f.inference_time)
            e.tpot.observe(f.mean_time_per_output_token)
            e.req_prompt_tokens.observe(f.num_prompt_tokens)
            e.req_generation_tokens.observe(f.num_generation_tokens)
            e.prefill_kv_computed.observe(max(f.num_prompt_tokens - f.num_cached_tokens, 0))
            if f.max_tokens:
                e.req_max_tokens.observe(f.max_tokens)
        for parent in it.finished_parents:
            e.req_max_generation.observe(parent.max_num_generation_tokens)
            e.req_n.observe(parent.n)

    def _record_spec(self, e: _EngineSeries, s: SchedulerStats) -> None:
        e.spec_drafts.inc(s.spec_num_drafts)
        e.spec_draft_tokens.inc(s.spec_num_draft_tokens)
        e.spec_accepted.inc(s.spec_num_accepted_tokens)
        per_pos = s.spec_num_accepted_tokens_per_pos or []
        while len(e.spec_per_pos) < len(per_pos):
            e.spec_per_pos.append(self.extra_families["spec_per_pos"].labels(
                *e.labels, str(len(e.spec_per_pos))))
        for child, n in zip(e.spec_per_pos, per_pos):
            child.inc(n)

    def _record_tier(self, e: _EngineSeries, tier: str, figures: dict[str, float]) -> None:
        self.tier_usage.labels(*e.labels, tier).set(figures.get("usage", 0.0))
        for field, family in self.tier_counters.items():
            entry = e.tiers.get((tier, field))
            if entry is None:
                entry = e.tiers[(tier, field)] = (family.labels(*e.labels, tier),
                                                  CumulativeDelta())
            child, delta = entry
            child.inc(delta(figures.get(field, 0)))

    def log(self) -> None:
        pass  # scraped, not logged
