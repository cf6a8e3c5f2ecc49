"""benchmarks/deepseek_v4_gpu.py all --smoke: every part of the DeepSeek-V4 GPU script on the
CPU, against tiny V4 and MLA configs, its stages in child processes as on the GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu_script  # make gpu-script-smoke


def test_deepseek_v4_gpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "v4.json"
    proc = subprocess.run([sys.executable, "benchmarks/deepseek_v4_gpu.py", "all", "--smoke",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r["workload"]: r for r in json.loads(out.read_text())}
    assert sorted(records) == sorted(["kv_bytes", "batch1", "long_context", "w1",
                                      "long_context_mla", "correctness",
                                      "long_context_summary"])

    # the tiny config in float32 against transformers' full forward: every token, 1e-4
    corr = records["correctness"]
    assert corr["token_match_fraction"] == 1.0 and corr["max_logprob_diff"] < 1e-4

    # a token of context: CSA entries (32 + the indexer's 32 values per 4 tokens) and HCA
    # entries (32 per 16 tokens), 4 B each; MLA: 4 layers x (32 + 16) x 4 B
    kv = records["kv_bytes"]
    assert kv["context_bytes_per_token"] == 64 + 8 and kv["mla_bytes_per_token"] == 768
    # per request: 4 windows of 8 rows of 32 values, CSA's open groups (8 rows of 64 kv +
    # gate and 64 indexer values) and HCA's (16 rows of 32 + 32), 4 B each
    assert kv["layout"]["bounded_bytes_per_request"] == 4 * 8 * 128 + 8 * 1024 + 16 * 256

    b1 = records["batch1"]
    assert b1["output_tokens"] == b1["output_len"] == 12 and b1["decode_tok_s"] > 0
    p = b1["params"]
    assert (p["moe_layers"], p["num_routed_experts"], p["num_experts_per_tok"]) == (4, 8, 2)
    assert b1["weight_bytes_per_token"] == p["active_params"] * 4

    w1 = records["w1"]
    assert w1["total_output_tokens"] == w1["expected_output_tokens"] > 0

    rows = records["long_context_summary"]["contexts"]
    assert [r["context"] for r in rows] == [64, 256, 480]
    for r in rows:
        assert r["v4_decode_ms"] > 0 and r["mla_decode_ms"] > 0
        assert r["v4_kv_bytes"] == 72 * r["context"] + 4 * 128 * 8 + 8 * 1024 + 16 * 256
        assert r["mla_kv_bytes"] == 768 * r["context"]
