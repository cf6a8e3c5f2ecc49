"""The GPU scripts the before/after sweep runs, at --smoke size on the CPU with the engine
internals switched off (SHOAL_BENCH_PUBLIC_ONLY=1, as gpu_run.sh --trees runs them): each
writes its record with the figures the sweep compares."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu_script  # make gpu-script-smoke


def run(script: str, *args: str, out: Path) -> list[dict]:
    env = {**os.environ, "SHOAL_BENCH_PUBLIC_ONLY": "1", "SHOAL_COMMIT": "test"}
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", *args, "--smoke", "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_gpu_suite_w1_and_w2(tmp_path: Path) -> None:
    (w1,) = run("gpu_suite.py", "w1", "--num-runs", "2", out=tmp_path / "w1.json")
    assert w1["workload"] == "W1" and w1["commit"] == "test"
    assert w1["total_output_tokens"] > 0 and len(w1["runs_output_tok_s"]) == 2
    assert w1["ready_s"] > 0 and w1["process_ready_s"] >= w1["ready_s"]
    (w2,) = run("gpu_suite.py", "w2", "--no-profile", out=tmp_path / "w2.json")
    assert w2["output_tokens"] == w2["output_len"] == 12 and w2["output_tok_s"] > 0
    assert w2["graph_replay_ms"] is None  # an engine internal: off in the sweep


def test_spec_decode_one_engine_per_rate(tmp_path: Path) -> None:
    (rec,) = run("spec_decode_gpu.py", "--rates", "0.8", out=tmp_path / "w9.json")
    assert rec["public_only"] and len(rec["runs"]["spec"]) == 2  # 1 rate x 2 batch sizes
    row = rec["summary"]["batch_1"]
    assert row["plain_tok_s"] > 0 and row["spec_a0.8_tok_s"] > 0
    assert row["plain_ms_per_step"] is None  # steps are counted on the runner: internal
