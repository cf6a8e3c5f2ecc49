"""Prometheus collectors per registry, counter deltas from cumulative totals, the log line."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from shoal.core.types import SchedulerStats
from shoal.metrics import (
    FinishedParentStats,
    FinishedRequestStats,
    IterationStats,
    LoggingStatLogger,
    PrometheusStatLogger,
)
from shoal.metrics.stats import CumulativeDelta

M = "m"


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    v = registry.get_sample_value(name, {"model_name": M, "engine": "0", **labels})
    assert v is not None, name
    return v


def test_two_loggers_in_one_process_do_not_clash():
    a, b = PrometheusStatLogger(M), PrometheusStatLogger(M)
    assert a.registry is not b.registry
    text = generate_latest(a.registry).decode()
    assert 'shoal:kv_cache_usage_perc{engine="0",model_name="m"} 0.0' in text
    assert ('shoal:request_success_total{engine="0",finished_reason="stop",model_name="m"} 0.0'
            in text)


def test_scheduler_stats_gauges_and_counters():
    p = PrometheusStatLogger(M)
    r = p.registry
    p.record(SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.5,
                            prefix_cache_queries=100, prefix_cache_hits=40, num_preemptions=1,
                            num_prompt_tokens=30, num_generation_tokens=2), IterationStats())
    p.record(SchedulerStats(num_running=1, kv_cache_usage=0.25, prefix_cache_queries=150,
                            prefix_cache_hits=40, num_preemptions=1, num_generation_tokens=1),
             IterationStats())
    assert _value(r, "shoal:num_requests_running") == 1
    assert _value(r, "shoal:num_requests_waiting") == 0
    assert _value(r, "shoal:kv_cache_usage_perc") == 0.25
    assert _value(r, "shoal:prefix_cache_queries_total") == 150  # cumulative, not summed
    assert _value(r, "shoal:prefix_cache_hits_total") == 40
    assert _value(r, "shoal:num_preemptions_total") == 1
    assert _value(r, "shoal:generation_tokens_total") == 3  # per-step deltas, summed
    # tokens per engine step: 30 + 2, then 1
    assert _value(r, "shoal:iteration_tokens_total_count") == 2
    assert _value(r, "shoal:iteration_tokens_total_sum") == 33


def test_image_cache_queries_and_hits_count_items_cumulatively():
    """vLLM's mm_cache_queries / mm_cache_hits: every image looked up in the encoder cache
    (encoded or found) and the ones found."""
    p = PrometheusStatLogger(M)
    p.record(SchedulerStats(mm_items_encoded=2, mm_cache_hits=1), IterationStats())
    p.record(SchedulerStats(mm_items_encoded=3, mm_cache_hits=4), IterationStats())
    assert _value(p.registry, "shoal:mm_cache_queries_total") == 7
    assert _value(p.registry, "shoal:mm_cache_hits_total") == 4
    assert _value(p.registry, "vllm:mm_cache_hits_total") == 4


def test_prompt_tokens_count_whole_prompts_with_their_cached_part():
    # vLLM's semantics: a prompt counts whole when its first token comes (cache hits too).
    p = PrometheusStatLogger(M)
    r = p.registry
    p.record(None, IterationStats(num_prompt_tokens=40, num_cached_prompt_tokens=32,
                                  num_generation_tokens=1))
    assert _value(r, "shoal:prompt_tokens_total") == 40
    assert _value(r, "vllm:prompt_tokens_total") == 40
    assert _value(r, "vllm:prompt_tokens_cached_total") == 32
    assert _value(r, "vllm:prompt_tokens_by_source_total", source="local_compute") == 8
    assert _value(r, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") == 32


def test_latency_histograms_and_finished_requests():
    p = PrometheusStatLogger(M)
    it = IterationStats(time_to_first_tokens=[0.1, 0.2], inter_token_latencies=[0.05],
                        queue_times=[0.01],
                        finished=[FinishedRequestStats("length", 1.5, 10, 4),
                                  FinishedRequestStats("abort", 0.5, 3, 1)])
    p.record(None, it)
    r = p.registry
    assert _value(r, "shoal:time_to_first_token_seconds_count") == 2
    assert abs(_value(r, "shoal:time_to_first_token_seconds_sum") - 0.3) < 1e-9
    assert _value(r, "shoal:inter_token_latency_seconds_count") == 1
    assert _value(r, "shoal:request_queue_time_seconds_count") == 2  # one per finished request
    assert _value(r, "shoal:e2e_request_latency_seconds_count") == 2
    assert _value(r, "shoal:request_success_total", finished_reason="length") == 1
    assert _value(r, "shoal:request_success_total", finished_reason="abort") == 1


def test_cumulative_delta_survives_a_reset():
    d = CumulativeDelta()
    assert [d(10), d(15), d(15), d(3), d(5)] == [10, 5, 0, 3, 2]


def test_log_line_only_while_active():
    log = LoggingStatLogger()
    assert log.format_line(now=log._last_time + 10) is None  # idle: nothing to say
    log.record(SchedulerStats(num_running=1, kv_cache_usage=0.125, num_prompt_tokens=100,
                              num_generation_tokens=20, prefix_cache_queries=10,
                              prefix_cache_hits=5), IterationStats())
    line = log.format_line(now=log._last_time + 10)
    assert line is not None
    assert "prompt throughput: 10.0 tokens/s" in line
    assert "generation throughput: 2.0 tokens/s" in line
    assert "Running: 1 reqs" in line and "KV cache usage: 12.5%" in line
    assert "hit rate: 50.0%" in line
    log.record(SchedulerStats(), IterationStats())
    assert log.format_line(now=log._last_time + 10) is not None  # one closing line at zero
    assert log.format_line(now=log._last_time + 10) is None


def test_kv_offload_tier_metrics_by_tier():
    p = PrometheusStatLogger(M)
    r = p.registry
    tiers = {"cpu": {"usage": 0.5, "queries": 10, "hits": 4, "bytes_loaded": 4096,
                     "load_seconds": 0.25},
             "disk": {"usage": 0.1, "queries": 6, "hits": 1, "damaged": 1}}
    p.record(SchedulerStats(kv_tiers=tiers), IterationStats())
    tiers["cpu"] = {**tiers["cpu"], "queries": 12, "hits": 5, "usage": 0.75}
    p.record(SchedulerStats(kv_tiers=tiers), IterationStats())
    assert _value(r, "shoal:kv_offload_usage_perc", tier="cpu") == 0.75
    assert _value(r, "shoal:kv_offload_queries_total", tier="cpu") == 12  # cumulative
    assert _value(r, "shoal:kv_offload_hits_total", tier="cpu") == 5
    assert _value(r, "shoal:kv_offload_bytes_loaded_total", tier="cpu") == 4096
    assert _value(r, "shoal:kv_offload_load_seconds_total", tier="cpu") == 0.25
    assert _value(r, "shoal:kv_offload_damaged_total", tier="disk") == 1
    assert _value(r, "shoal:kv_offload_usage_perc", tier="disk") == 0.1


def test_vllm_families_under_both_prefixes_or_one():
    p = PrometheusStatLogger(M, max_model_len=1024, cache_info={"block_size": "16",
                                                                "kv_cache_size_tokens": "4096"})
    p.record(SchedulerStats(num_waiting=3, num_waiting_deferred=1), IterationStats(finished=[
        FinishedRequestStats("length", 2.0, 10, 5, max_tokens=5, num_cached_tokens=4,
                             queued_time=0.5, prefill_time=0.25, decode_time=1.0,
                             inference_time=1.25, mean_time_per_output_token=0.25)],
        finished_parents=[FinishedParentStats(n=2, max_num_generation_tokens=3)]))
    r = p.registry
    for prefix in ("vllm", "shoal"):
        assert _value(r, f"{prefix}:request_queue_time_seconds_sum") == 0.5
        assert _value(r, f"{prefix}:request_prefill_time_seconds_sum") == 0.25
        assert _value(r, f"{prefix}:request_decode_time_seconds_sum") == 1.0
        assert _value(r, f"{prefix}:request_inference_time_seconds_sum") == 1.25
        assert _value(r, f"{prefix}:request_prompt_tokens_sum") == 10
        assert _value(r, f"{prefix}:request_generation_tokens_sum") == 5
        assert _value(r, f"{prefix}:request_params_n_sum") == 2
        assert _value(r, f"{prefix}:request_params_max_tokens_sum") == 5
        assert _value(r, f"{prefix}:request_max_num_generation_tokens_sum") == 3
        assert _value(r, f"{prefix}:request_prefill_kv_computed_tokens_sum") == 6
        assert _value(r, f"{prefix}:request_time_per_output_token_seconds_sum") == 0.25
        assert _value(r, f"{prefix}:num_requests_waiting_by_reason", reason="capacity") == 2
        assert _value(r, f"{prefix}:num_requests_waiting_by_reason", reason="deferred") == 1
        assert _value(r, f"{prefix}:engine_sleep_state", sleep_state="awake") == 1
        assert r.get_sample_value(f"{prefix}:cache_config_info",
                                  {"block_size": "16", "kv_cache_size_tokens": "4096"}) == 1
    # token-count buckets grow 1-2-5 up to max_model_len, as vLLM's
    text = generate_latest(r).decode()
    assert 'vllm:request_prompt_tokens_bucket{engine="0",le="1000.0",model_name="m"}' in text
    assert 'le="2000.0",model_name="m"' not in text
    only = PrometheusStatLogger(M, prefixes=["vllm"])
    text = generate_latest(only.registry).decode()
    assert "vllm:num_requests_running" in text and "shoal:" not in text


def test_an_unknown_finish_reason_gets_its_own_series():
    p = PrometheusStatLogger(M)
    p.record(None, IterationStats(finished=[FinishedRequestStats("timeout", 1.0, 3, 1)]))
    assert _value(p.registry, "vllm:request_success_total", finished_reason="timeout") == 1


def test_series_per_engine_and_the_log_line_over_all():
    """Data parallelism: each replica's state under its own engine label (vLLM's), the log
    line over the whole server."""
    p, log = PrometheusStatLogger(M), LoggingStatLogger()
    for logger in (p, log):
        logger.record(SchedulerStats(num_running=3, kv_cache_usage=0.5, prefix_cache_hits=4,
                                     num_generation_tokens=3), IterationStats(), 0)
        logger.record(SchedulerStats(num_running=2, kv_cache_usage=0.25, prefix_cache_hits=6,
                                     num_generation_tokens=2), IterationStats(
            finished=[FinishedRequestStats("stop", 1.0, 3, 1)]), 1)
    r = p.registry
    assert _value(r, "vllm:num_requests_running") == 3
    assert _value(r, "vllm:num_requests_running", engine="1") == 2
    assert _value(r, "vllm:prefix_cache_hits_total", engine="1") == 6
    assert _value(r, "vllm:request_success_total", engine="1", finished_reason="stop") == 1
    assert _value(r, "vllm:request_success_total", finished_reason="stop") == 0
    line = log.format_line(now=log._last_time + 1)
    assert line is not None
    assert "Running: 5 reqs" in line and "KV cache usage: 37.5%" in line
    assert "generation throughput: 5.0 tokens/s" in line
