"""benchmarks/eagle3_step_profile.py at --smoke size on the CPU (make gpu-script-smoke: an
engine, not in make test): every phase of the EAGLE-3 drafter is timed per step, and at rate
0 (requests back off from drafting) most steps run no mirror pass (mirror_backlog.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu_script  # make gpu-script-smoke


def test_eagle3_step_profile_smoke(tmp_path: Path) -> None:
    out = tmp_path / "e3.json"
    proc = subprocess.run([sys.executable, "benchmarks/eagle3_step_profile.py", "--smoke",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res) == {"1", "4"} and set(res["1"]) == {"0.0", "1.0"}
    every, none = res["1"]["1.0"], res["1"]["0.0"]
    # Rate 1: each step after the prefill verifies k drafts and proposes again.
    assert every["propose"]["calls"] == every["mirror_pass"]["calls"] == every["steps"]
    assert every["ms_per_step"] > 0 and every["propose"]["host_ms_per_step"] > 0
    # Rate 0: paused steps are not mirrored (a third of them would be plenty).
    assert none["mirror_pass"]["calls"] < none["steps"] // 3
