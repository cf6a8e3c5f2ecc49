"""benchmarks/gpt_oss_gpu.py all --smoke: both parts of the GPT-OSS GPU script on the CPU,
against a tiny gpt-oss config, in a subprocess as the team runs it; and its floor's
arithmetic on the shipped GPT-OSS-20B shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu_script  # make gpu-script-smoke


def test_gpt_oss_gpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "gptoss.json"
    env = {**os.environ, "SHOAL_COMMIT": "test"}
    proc = subprocess.run([sys.executable, "benchmarks/gpt_oss_gpu.py", "all", "--smoke",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    b1, w1 = json.loads(out.read_text())
    for rec in (b1, w1):
        assert rec["commit"] == "test" and "gpu" in rec and rec["smoke"]
        # the CPU has no MXFP4 kernel: the experts of both layers are unpacked, dense
        assert rec["experts_form"] == {"dense": 2} and rec["model_weight_bytes"] > 0
    assert b1["workload"] == "gptoss_batch1" and b1["output_tokens"] == 12
    assert b1["output_tok_s"] > 0 and b1["floor_tok_s"] > 0
    assert b1["weight_bytes_per_token"] == sum(b1["weight_bytes_by_part"].values())
    assert w1["workload"] == "gptoss_w1" and w1["num_requests"] == 6
    assert w1["total_output_tokens"] == w1["expected_output_tokens"] > 0


def test_floor_of_the_shipped_gpt_oss_20b_shape() -> None:
    """bf16 attention 1.27 GB, 4 MXFP4 experts of 24.9M weights a layer 1.27 GB, LM head
    1.16 GB: 3.70 GB a token, 811 tok/s at the H100's 3.0 TB/s."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import gpt_oss_gpu
    finally:
        sys.path.pop(0)
    cfg = json.loads((ROOT / "shoal/model_configs/gpt-oss-20b/config.json").read_text())
    b = gpt_oss_gpu.active_bytes(cfg)
    parts = b["bytes_by_part"]
    assert b["experts_per_token"] == 4 and b["layers"] == 24
    # gate_up 5760 x 2880 and down 2880 x 2880 at 17/32 byte, biases 8640 x 2 bytes
    assert b["expert_bytes_each"] == 24_883_200 * 17 / 32 + 8640 * 2
    assert parts["lm_head"] == 201088 * 2880 * 2 and parts["embedding_row"] == 2880 * 2
    assert parts["attention"] == 24 * (2880 * 5120 + 4096 * 2880 + 64 + 5120 + 2880) * 2
    assert 3.69e9 < b["bytes_per_token"] < 3.71e9
