"""`shoal bench serve` end to end against the fake server: exact counts, timings, files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from shoal.benchmarks.load import arrival_times
from shoal.benchmarks.serve import run
from shoal.cli import build_parser, main


def _ns(server, *args):
    return build_parser().parse_args(["bench", "serve", "--base-url", server.base_url,
                                      "--skip-tokenizer-init", "--disable-tqdm", *args])


def test_counts_are_exact_and_keys_are_vllms(fake_server, tmp_path):
    res = run(_ns(fake_server, "--num-prompts", "40", "--random-input-len", "20",
                  "--random-output-len", "30", "--random-range-ratio", "0.5",
                  "--max-concurrency", "8", "--save-result", "--save-detailed",
                  "--result-dir", str(tmp_path), "--result-filename", "r.json",
                  "--metric-percentiles", "50,90,99"))
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["completed"] == 40 and saved["failed"] == 0
    assert saved["total_output_tokens"] == sum(saved["output_lens"])
    assert all(15 <= n <= 45 for n in saved["output_lens"])
    assert saved["total_input_tokens"] == sum(saved["input_lens"])
    assert all(10 <= n <= 30 for n in saved["input_lens"])
    for key in ("request_throughput", "output_throughput", "total_token_throughput",
                "date", "backend", "model_id", "num_prompts", "request_rate",
                "max_concurrency", "ttfts", "itls", "start_times", "errors", "duration"):
        assert key in saved, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p50", "p90", "p99"):
            assert f"{stat}_{metric}_ms" in saved
    assert saved["max_concurrency"] == 8 and saved["max_concurrent_requests"] <= 8
    assert saved["request_rate"] == "inf" and saved["model_id"] == "fake-model"
    assert [len(x) for x in saved["itls"]] == [n - 1 for n in saved["output_lens"]]
    assert res["ignore_eos"] is True  # the random dataset ignores EOS, as vLLM's


def test_non_streaming_chat_and_plot(fake_server, tmp_path):
    png = tmp_path / "p.png"
    res = run(_ns(fake_server, "--num-prompts", "6", "--random-input-len", "8",
                  "--random-output-len", "5", "--non-streaming", "--max-concurrency", "2",
                  "--plot", str(png)))
    assert res["completed"] == 6 and res["total_output_tokens"] == 30
    assert res["stream"] is False
    assert res["mean_ttft_ms"] == pytest.approx(res["mean_e2el_ms"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="chat endpoint needs text"):
        run(_ns(fake_server, "--num-prompts", "2", "--endpoint", "/v1/chat/completions"))


def test_known_timings_are_measured(slow_fake_server):
    # TTFT 50 ms, ITL 10 ms on the server; the client adds little on top.
    res = run(_ns(slow_fake_server, "--num-prompts", "4", "--random-input-len", "4",
                  "--random-output-len", "11", "--max-concurrency", "4"))
    assert res["completed"] == 4 and res["total_output_tokens"] == 44
    assert 50 <= res["mean_ttft_ms"] < 150
    assert 9 <= res["median_itl_ms"] < 40
    assert 10 <= res["mean_tpot_ms"] < 40
    assert 150 <= res["mean_e2el_ms"] < 500


def test_poisson_arrivals_are_seeded_and_paced(fake_server):
    a = arrival_times(200, request_rate=50.0, seed=3)
    assert a == arrival_times(200, request_rate=50.0, seed=3)
    assert a != arrival_times(200, request_rate=50.0, seed=4)
    assert a[-1] == pytest.approx(200 / 50.0)  # scaled to last exactly n / rate
    gaps = np.diff([0.0, *a])
    assert np.all(gaps >= 0) and 0.5 < gaps.std() / gaps.mean() < 1.5  # exponential: cv ~ 1
    smooth = np.diff([0.0, *arrival_times(200, 50.0, burstiness=50.0, seed=3)])
    assert smooth.std() / smooth.mean() < 0.3
    assert arrival_times(3, math.inf) == [0.0, 0.0, 0.0]
    res = run(_ns(fake_server, "--num-prompts", "8", "--random-input-len", "4",
                  "--random-output-len", "2", "--request-rate", "40", "--seed", "5",
                  "--save-detailed"))
    starts = np.array(res["start_times"]) - min(res["start_times"])
    expected = np.array(arrival_times(8, 40.0, seed=5))
    assert np.allclose(starts, expected - expected[0], atol=0.03)


def test_two_client_processes_merge_in_order(fake_server, tmp_path):
    code = main(["bench", "serve", "--base-url", fake_server.base_url, "--skip-tokenizer-init",
                 "--disable-tqdm", "--num-prompts", "12", "--random-input-len", "6",
                 "--random-output-len", "3", "--random-range-ratio", "0.5",
                 "--max-concurrency", "4", "--num-client-processes", "2", "--save-result",
                 "--save-detailed", "--result-dir", str(tmp_path), "--result-filename",
                 "mp.json"])
    assert code == 0
    saved = json.loads((tmp_path / "mp.json").read_text())
    single = run(_ns(fake_server, "--num-prompts", "12", "--random-input-len", "6",
                     "--random-output-len", "3", "--random-range-ratio", "0.5",
                     "--save-detailed"))
    assert saved["completed"] == 12 and saved["num_client_processes"] == 2
    assert saved["output_lens"] == single["output_lens"]  # same requests, same order
    assert saved["input_lens"] == single["input_lens"]
