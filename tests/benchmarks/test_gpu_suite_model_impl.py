"""gpu_suite.py --model-impl at --smoke size on the CPU: the part's engine runs the model
through the path asked for (the Transformers backend against shoal's own class on one
shape), and the record says which class ran and whether the engine kept CUDA graphs (never on
the CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu_script  # make gpu-script-smoke


@pytest.mark.parametrize("impl", ["transformers", "shoal"])
def test_w2_records_the_model_impl(tmp_path: Path, impl: str) -> None:
    out = tmp_path / "w2.json"
    env = {**os.environ, "SHOAL_COMMIT": "test"}  # engine internals on: cuda_graphs is read
    proc = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "w2", "--smoke",
                           "--no-profile", "--model-impl", impl, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = json.loads(out.read_text())
    assert rec["model_impl"] == impl and rec["cuda_graphs"] is False
    assert rec["model_class"] == ("TransformersForCausalLM" if impl == "transformers"
                                  else "LlamaForCausalLM")
    assert rec["output_tokens"] == 12
