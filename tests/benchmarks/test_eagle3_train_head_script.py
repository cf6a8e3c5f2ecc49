"""benchmarks/eagle3_train_head.py --smoke on the CPU with the GPU run's path (make
gpu-script-smoke, not in make test): a random-weight target (load_format dummy, an 8-layer
tiny Llama), random-id prompts, the heads loaded into the running engine in place. The run
ends with a record whose greedy outputs match plain decoding's and whose served aux states
are the ones trained on."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu_script  # make gpu-script-smoke


def test_eagle3_train_head_smoke_dummy_target(tmp_path: Path) -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import offline_runs
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    model = Path(offline_runs.tiny_llama(tmp_path / "tiny"))
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_hidden_layers"] = 8  # the default aux layers 2, L // 2, L - 3 need six
    (model / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "e3.json"
    proc = subprocess.run([sys.executable, "benchmarks/eagle3_train_head.py", "--smoke",
                           "--model", str(model), "--load-format", "dummy", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["summary"]["identical_outputs"] and rec["summary"]["serve_time_aux_ok"]
    assert rec["train"]["steps_done"] == 10 and rec["random_prompts"]
    for mode in ("batch_1", "batch_2"):
        assert set(rec["modes"][mode]) == {"plain", "random", "trained"}
        assert rec["modes"][mode]["trained"]["num_drafts"] > 0
    assert "SUMMARY eagle3 head trained 10 steps" in proc.stdout
