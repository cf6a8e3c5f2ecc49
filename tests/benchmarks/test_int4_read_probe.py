"""benchmarks/int4_read_probe.py at --smoke size on the CPU (Triton's interpreter): its read
kernels xor every code once (GPTQ's layout and tile_codes' agree with numpy), and the GEMV
gives the same bits on either layout, so its GPU figures compare like with like; and the GPU
run's bookkeeping at a 256-wide shape, a call of each kind made once instead of timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_probe_smoke_checks_its_kernels(tmp_path: Path) -> None:
    out = tmp_path / "probe.json"
    proc = subprocess.run([sys.executable, "benchmarks/int4_read_probe.py", "--smoke", "--out",
                           str(out)], cwd=ROOT, env={**os.environ, "SHOAL_COMMIT": "test"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    smoke = json.loads(out.read_text())["smoke"]
    assert smoke == {"checked_read_sums": 4, "gemv_layouts_agree": True, "flat_agrees": True,
                     "cells": 3}
