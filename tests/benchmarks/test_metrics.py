"""The metrics on synthetic timings: known inputs, hand-computed figures."""

from __future__ import annotations

import math

import pytest

from shoal.benchmarks.metrics import (
    calculate_metrics,
    output_len,
    parse_goodput,
    peak_concurrency,
    summary_lines,
    tokens_over_time,
)
from shoal.benchmarks.request_funcs import RequestOutput


def _out(start, ttft, itl, tokens, prompt_len=10, ok=True):
    latency = ttft + sum(itl)
    return RequestOutput(success=ok, error="" if ok else "boom", prompt_len=prompt_len,
                         output_tokens=tokens, chunks=len(itl) + 1, ttft=ttft, itl=list(itl),
                         latency=latency, start_time=start)


def test_percentiles_means_and_throughput_on_known_timings():
    outs = [
        _out(0.0, 0.010, [0.010, 0.010, 0.010], 4),   # e2e 40 ms, tpot 10 ms
        _out(0.0, 0.020, [0.020, 0.020, 0.020], 4),   # e2e 80 ms, tpot 20 ms
        _out(0.1, 0.030, [0.030, 0.030, 0.030], 4),   # e2e 120 ms, tpot 30 ms
        _out(0.1, 0.040, [0.040, 0.040, 0.040], 4),   # e2e 160 ms, tpot 40 ms
        _out(0.2, 0.5, [], 0, ok=False),               # failed: counted, not timed
    ]
    res = calculate_metrics(outs, duration_s=2.0, percentiles=[25, 50, 99, 99.9])
    assert res["completed"] == 4 and res["failed"] == 1
    assert res["total_input_tokens"] == 40 and res["total_output_tokens"] == 16
    assert res["request_throughput"] == pytest.approx(2.0)
    assert res["output_throughput"] == pytest.approx(8.0)
    assert res["total_token_throughput"] == pytest.approx(28.0)
    # TTFTs 10, 20, 30, 40 ms: numpy's linear interpolation between order statistics.
    assert res["mean_ttft_ms"] == pytest.approx(25.0)
    assert res["median_ttft_ms"] == pytest.approx(25.0)
    assert res["std_ttft_ms"] == pytest.approx(math.sqrt(125.0))
    assert res["p25_ttft_ms"] == pytest.approx(17.5)
    assert res["p99_ttft_ms"] == pytest.approx(39.7)
    assert res["p99.9_ttft_ms"] == pytest.approx(39.97)
    # TPOT = (e2e - ttft) / (tokens - 1) = the ITL here.
    assert res["mean_tpot_ms"] == pytest.approx(25.0)
    assert res["p99_tpot_ms"] == pytest.approx(39.7)
    # ITLs pooled: 3 x each of 10, 20, 30, 40 -> median 25, p25 = 17.5 (index 2.75).
    assert res["median_itl_ms"] == pytest.approx(25.0)
    assert res["p25_itl_ms"] == pytest.approx(17.5)
    assert res["mean_e2el_ms"] == pytest.approx(100.0)
    assert res["p50_e2el_ms"] == pytest.approx(100.0)
    assert res["max_concurrent_requests"] == 2  # [0, 40) and [0, 80) ms; then two from 100 ms
    assert res["output_lens"] == [4, 4, 4, 4, 0] and res["errors"][-1] == "boom"
    assert res["request_goodput"] is None


def test_goodput_counts_requests_meeting_every_slo():
    outs = [_out(0.0, 0.010, [0.010] * 3, 4), _out(0.0, 0.020, [0.020] * 3, 4),
            _out(0.0, 0.030, [0.030] * 3, 4)]
    res = calculate_metrics(outs, 1.0, goodput=parse_goodput(["ttft:25", "tpot:15"]))
    assert res["request_goodput"] == pytest.approx(1.0)  # only the first meets both
    res = calculate_metrics(outs, 1.0, goodput=parse_goodput(["e2el:100"]))
    assert res["request_goodput"] == pytest.approx(2.0)
    with pytest.raises(ValueError):
        parse_goodput(["itl:5"])


def test_output_length_fallbacks():
    class Tok:
        def encode(self, text, add_special_tokens=False):
            return text.split()

    o = RequestOutput(success=True, output_tokens=0, chunks=3, generated_text="a b c d e")
    assert output_len(o) == 3
    assert output_len(o, Tok()) == 5
    o.output_tokens = 7
    assert output_len(o, Tok()) == 7


def test_tokens_over_time_and_peak_concurrency():
    outs = [_out(0.0, 0.5, [1.0, 1.0], 3), _out(2.6, 0.1, [], 1)]
    tok_s, running = tokens_over_time(outs, [3, 1])
    assert tok_s.tolist() == [1.0, 1.0, 2.0, 0.0]  # tokens at 0.5, 1.5, 2.5 and 2.7 s
    assert running.tolist()[:3] == [1.0, 1.0, 2.0]
    assert peak_concurrency(outs) == 1  # [0, 2.5) and [2.6, 2.7) never overlap


def test_summary_table_has_vllm_rows():
    res = calculate_metrics([_out(0.0, 0.01, [0.01], 2)], 1.0, percentiles=[50, 99])
    text = "\n".join(summary_lines(res, ["ttft", "itl"], [50, 99], 16, 4.0, goodput=False))
    for row in ("Successful requests:", "Maximum request concurrency:",
                "Request rate configured (RPS):", "Benchmark duration (s):",
                "Total generated tokens:", "Output token throughput (tok/s):",
                "Mean TTFT (ms):", "P99 ITL (ms):", "P50 TTFT (ms):"):
        assert row in text
    assert "TPOT" not in text
