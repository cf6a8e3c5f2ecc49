"""benchmarks/disagg_gpu.py (W15, prefill/decode disaggregation) at --smoke size on the CPU:
both layouts (one engine; a prefill and a decode engine behind `shoal proxy`) write their
TTFT / ITL percentiles and throughput at each concurrency, layout b's requests all go with
the prefill engine's KV, the KV transfer is timed, and the summary holds b over a."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIGURES = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms",
           "request_throughput", "output_throughput")


@pytest.mark.slow
def test_disagg_gpu_smoke_both_layouts(tmp_path: Path) -> None:
    out = tmp_path / "disagg.json"
    env = {**os.environ, "SHOAL_COMMIT": "test"}
    proc = subprocess.run([sys.executable, "benchmarks/disagg_gpu.py", "--smoke",
                           "--concurrency", "2", "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["workload"] == "W15" and rec["commit"] == "test" and rec["smoke"]
    assert rec["concurrency"] == [2] and set(rec["layouts"]) == {"a", "b"}
    for layout in ("a", "b"):
        got = rec["layouts"][layout]
        assert "error" not in got and set(got["runs"]) == {"2"}
        for conc, run in got["runs"].items():
            assert run["completed"] == run["num_prompts"] == 2 * int(conc)
            assert run["failed"] == 0 and run["total_output_tokens"] == 8 * run["completed"]
            # (ITL may read 0 on a busy 2-core host: the stream can bring 8 tokens at once)
            assert all(run[k] >= 0 for k in FIGURES) and run["median_ttft_ms"] > 0, run
            assert run["request_throughput"] > 0 and run["output_throughput"] > 0
            assert run["command"].startswith("shoal bench serve")
            if layout == "b":  # every request decoded from the prefill engine's KV
                assert run["proxy_prefilled"] == run["completed"]
                assert run["proxy_recomputed"] == run["decode_failed_fetches"] == 0
    a, b = rec["layouts"]["a"], rec["layouts"]["b"]
    assert a["engine"]["kv_blocks"] > 0 and a["engine"]["gpu_memory_utilization"] == 0.9
    assert b["prefill"]["gpu_memory_utilization"] == 0.45 and b["decode"]["share"] == 0.45
    kv = b["kv_transfer"]
    assert len(kv["fetches"]) == 2 and kv["median_gb_per_s"] > 0
    assert all(f["tokens"] == 64 and f["bytes"] > 0 for f in kv["fetches"])
    summ = rec["summary"]
    assert summ["kv_transfer_gb_per_s"] == kv["median_gb_per_s"]
    for conc in ("2",):
        row = summ["by_concurrency"][conc]
        assert row["median_ttft_ms_b_over_a"] > 0 and row["output_throughput_b_over_a"] > 0
        assert all(f"{k}_b_over_a" in row for k in FIGURES)
        assert row["median_ttft_ms_a"] == a["runs"][conc]["median_ttft_ms"]
