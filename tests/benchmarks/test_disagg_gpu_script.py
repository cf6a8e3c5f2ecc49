"""benchmarks/disagg_gpu.py (W15, prefill/decode disaggregation) at --smoke size on the CPU:
layout b (a prefill and a decode engine behind `shoal proxy`) writes its TTFT / ITL
percentiles and throughput, its requests all go with the prefill engine's KV, the KV transfer
is timed; layout a (one engine: a plain `shoal serve` run, the same driver) is left out of the
smoke for test time, and the summary's b-over-a arithmetic is checked on its own."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
           "request_throughput", "output_throughput")


@pytest.mark.gpu_script
def test_disagg_gpu_smoke_layout_b(tmp_path: Path) -> None:
    out = tmp_path / "disagg.json"
    env = {**os.environ, "SHOAL_COMMIT": "test"}
    proc = subprocess.run([sys.executable, "benchmarks/disagg_gpu.py", "--smoke", "--layouts",
                           "b", "--concurrency", "2", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["workload"] == "W15" and rec["commit"] == "test" and rec["smoke"]
    assert rec["concurrency"] == [2] and set(rec["layouts"]) == {"b"}
    b = rec["layouts"]["b"]
    assert "error" not in b and set(b["runs"]) == {"2"}
    for conc, run in b["runs"].items():
        assert run["completed"] == run["num_prompts"] == 2 * int(conc)
        assert run["failed"] == 0 and run["total_output_tokens"] == 8 * run["completed"]
        # (ITL may read 0 on a busy 2-core host: the stream can bring 8 tokens at once)
        assert all(run[k] >= 0 for k in FIGURES) and run["median_ttft_ms"] > 0, run
        assert run["request_throughput"] > 0 and run["output_throughput"] > 0
        assert run["command"].startswith("shoal bench serve")
        # every request decoded from the prefill engine's KV
        assert run["proxy_prefilled"] == run["completed"]
        assert run["proxy_recomputed"] == run["decode_failed_fetches"] == 0
    assert b["prefill"]["gpu_memory_utilization"] == 0.45 and b["decode"]["share"] == 0.45
    kv = b["kv_transfer"]
    assert len(kv["fetches"]) == 2 and kv["median_gb_per_s"] > 0
    assert all(f["tokens"] == 64 and f["bytes"] > 0 for f in kv["fetches"])
    assert rec["summary"] == {"by_concurrency": {}, "kv_transfer_gb_per_s": kv["median_gb_per_s"]}


def test_summary_is_b_over_a_at_each_concurrency_both_ran() -> None:
    spec = importlib.util.spec_from_file_location("disagg_gpu", ROOT / "benchmarks" /
                                                  "disagg_gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    run_a = {k: 2.0 for k in FIGURES}
    run_b = {k: 3.0 for k in FIGURES} | {"p99_itl_ms": 0.0}
    layouts = {"a": {"runs": {"2": run_a, "8": run_a}},
               "b": {"runs": {"2": run_b}, "kv_transfer": {"median_gb_per_s": 1.5}}}
    summ = mod.summary(layouts)
    assert summ["kv_transfer_gb_per_s"] == 1.5 and set(summ["by_concurrency"]) == {"2"}
    row = summ["by_concurrency"]["2"]
    assert row["median_ttft_ms_b_over_a"] == row["output_throughput_b_over_a"] == 1.5
    assert row["p99_itl_ms_b_over_a"] == 0.0
    assert row["median_ttft_ms_a"] == 2.0 and row["median_ttft_ms_b"] == 3.0
