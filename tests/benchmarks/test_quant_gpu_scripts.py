"""The quantized-weights GPU scripts at --smoke size on the CPU (make gpu-script-smoke): batch-1
decode offline and through `shoal serve` (quant_gpu.py --serve), and W1/W3 with FP8 weights
and FP8 KV (quant_throughput_gpu.py); the records carry what the GPU runs are read for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu_script


def run(script: str, *args: str, out: Path) -> list[dict]:
    proc = subprocess.run([sys.executable, f"benchmarks/{script}", *args, "--smoke", "--out",
                           str(out)], cwd=ROOT, env={**os.environ, "SHOAL_COMMIT": "test"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_decode_offline_and_served(tmp_path: Path) -> None:
    (rec,) = run("quant_gpu.py", "decode", "--serve", "--variants", "bf16",
                 out=tmp_path / "q.json")
    row = rec["variants"]["bf16"]
    assert row["decode_tok_s"] > 0 and row["floor_tok_s"] > 0
    assert row["served"]["output_tokens"] == 8 and row["served"]["decode_tok_s"] > 0
    assert row["served_over_offline"] > 0


def test_w1_w3_with_fp8_kv(tmp_path: Path) -> None:
    (rec,) = run("quant_throughput_gpu.py", "--cases", "bf16/auto,bf16/fp8",
                 out=tmp_path / "t.json")
    base, fp8 = rec["cases"]["bf16/auto"], rec["cases"]["bf16/fp8"]
    for row in (base, fp8):
        assert row["w1"]["output_tok_s"] > 0 and row["w3"]["total_output_tokens"] == 4 * 16
        assert row["kv_blocks"] > 0
    assert fp8["over_bf16"]["kv_blocks"] > 1.5  # fp8 KV: about twice the blocks
