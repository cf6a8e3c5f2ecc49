"""W9's --methods at --smoke size on the CPU (make gpu-script-smoke: engines, not in make
test): a real EAGLE-3 drafter under the forced rule, its rate changed in place, accepts every
draft at 1.0 (k + 1 tokens per verify step) and none at 0.0."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu_script  # make gpu-script-smoke


def test_spec_decode_methods_forced_and_eagle3(tmp_path: Path) -> None:
    out = tmp_path / "w9m.json"
    env = {k: v for k, v in os.environ.items() if k != "SHOAL_BENCH_PUBLIC_ONLY"}
    proc = subprocess.run([sys.executable, "benchmarks/spec_decode_gpu.py", "--smoke",
                           "--methods", "forced,eagle3", "--rates", "0.0,1.0", "--out", str(out)],
                          cwd=ROOT, env={**env, "SHOAL_COMMIT": "test"}, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = json.loads(out.read_text())
    assert rec["methods"] == ["forced", "eagle3"]
    runs = {(r["method"], r["batch"], r["acceptance_rate"]): r for r in rec["runs"]["spec"]}
    assert len(runs) == 2 * 2 * 2  # methods x batch sizes x rates
    k, n = rec["num_speculative_tokens"], rec["output_len"]
    for method in ("forced", "eagle3"):
        none, every = runs[(method, 1, 0.0)], runs[(method, 1, 1.0)]
        assert none["steps"] == n  # one token a step: the prefill's, then plain decodes
        assert every["steps"] == 1 + -(-(n - 1) // (k + 1))  # then k + 1 a verify step
    row = rec["summary"]["batch_4"]
    assert row["eagle3_a1.0_tok_s"] > 0 and row["spec_a0.0_tok_s"] > 0
