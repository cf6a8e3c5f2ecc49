"""`shoal bench throughput | latency` on the embedded model, and the presets."""

from __future__ import annotations

import json

from shoal.benchmarks.offline_common import apply_preset
from shoal.benchmarks.presets import SERVE_PRESETS, THROUGHPUT_PRESETS, apply_serve_preset
from shoal.cli import build_parser, main

SMALL = ["--kv-cache-memory-bytes", "134217728", "--max-model-len", "256", "--disable-tqdm"]


def test_throughput_counts_every_token(tmp_path):
    out = tmp_path / "t.json"
    assert main(["bench", "throughput", "--num-prompts", "3", "--input-len", "8",
                 "--output-len", "4", "--token-id-prompts", "--temperature", "0",
                 "--num-runs", "2", "--output-json", str(out), *SMALL]) == 0
    res = json.loads(out.read_text())
    assert res["num_requests"] == 3 and res["total_output_tokens"] == 12
    assert res["total_input_tokens"] == 24 and len(res["runs"]) == 2
    assert res["output_tokens_per_second"] > 0 and res["engine_args"]["max_model_len"] == 256


def test_latency_reports_percentiles(tmp_path):
    out = tmp_path / "l.json"
    assert main(["bench", "latency", "--input-len", "8", "--output-len", "4", "--batch-size",
                 "2", "--num-iters-warmup", "1", "--num-iters", "2", "--temperature", "0",
                 "--output-json", str(out), *SMALL]) == 0
    res = json.loads(out.read_text())
    assert len(res["latencies"]) == 2 and res["avg_latency"] > 0
    assert set(res["percentiles"]) == {"10", "25", "50", "75", "90", "99"}
    assert res["batch_size"] == 2 and res["output_len"] == 4


def test_presets_set_the_workload_and_flags_still_win():
    ns = build_parser().parse_args(["bench", "throughput", "--preset", "W1"])
    preset = apply_preset(ns, THROUGHPUT_PRESETS)
    assert (ns.model, ns.load_format, ns.dtype, ns.temperature) == (
        "Qwen/Qwen3-0.6B", "dummy", "bfloat16", 0.6)
    assert preset.num_prompts == 256 and preset.random.input_range == (100, 1024)
    assert preset.random.token_range == (0, 10001) and preset.random.nano_vllm_draws
    ns = build_parser().parse_args(["bench", "throughput", "--preset", "W1", "--dtype",
                                    "float32", "--temperature", "0"])
    apply_preset(ns, THROUGHPUT_PRESETS)
    assert (ns.dtype, ns.temperature) == ("float32", 0.0)
    ns = build_parser().parse_args(["bench", "serve", "--preset", "W8"])
    apply_serve_preset(ns)
    assert (ns.num_prompts, ns.max_concurrency, ns.temperature, ns.ignore_eos) == (
        256, 256, 0.6, True)
    assert SERVE_PRESETS["W4"].random.input_range == (256, 256)
