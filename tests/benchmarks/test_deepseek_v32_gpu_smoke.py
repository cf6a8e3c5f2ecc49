"""benchmarks/deepseek_v32_gpu.py all --smoke: every part of the DeepSeek-V3.2 GPU script on
the CPU, against tiny V3.2 and MLA configs, its stages in child processes as on the GPU."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from deepseek_v32_gpu import mla_config, read_config, v32_folder  # noqa: E402

pytestmark = pytest.mark.gpu_script  # make gpu-script-smoke


def test_mla_config_is_the_cut_without_its_indexer() -> None:
    v32 = read_config(v32_folder(argparse.Namespace(model=None)))  # the shipped cut
    mla = mla_config(v32)
    assert mla["architectures"] == ["DeepseekV3ForCausalLM"]
    assert not any(k.startswith("index_") for k in mla)
    kept = {k: v for k, v in v32.items() if not k.startswith("index_")
            and k not in ("architectures", "model_type")}
    assert {k: mla[k] for k in kept} == kept
    with pytest.raises(ValueError, match="index_topk"):
        mla_config(mla)


def test_deepseek_v32_gpu_smoke(tmp_path: Path) -> None:
    out = tmp_path / "v32.json"
    proc = subprocess.run([sys.executable, "benchmarks/deepseek_v32_gpu.py", "all", "--smoke",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [r["workload"] for r in json.loads(out.read_text())]
    # the summary comes before the W1 engine's stage
    assert records == ["kv_bytes", "long_context", "long_context_mla", "long_context_summary",
                       "batch1", "w1"]
    records = {r["workload"]: r for r in json.loads(out.read_text())}

    # a token of context: 4 layers x (latent 32 + rope 16 + indexer key 32) x 4 B; MLA 4 x 48 x 4
    kv = records["kv_bytes"]
    assert kv["context_bytes_per_token"] == 1280 and kv["matches_config"]
    assert kv["mla_bytes_per_token"] == 768 and kv["indexer_bytes_per_token"] == 512
    kinds = [r["kind"] for r in kv["layout"]["context_layers"]]
    assert kinds == ["LatentAttentionSpec", "IndexerKeySpec"] * 4

    assert records["long_context_mla"]["kv_bytes_per_token"] == 768
    rows = records["long_context_summary"]["contexts"]
    assert [r["context"] for r in rows] == [64, 256, 480]
    for r in rows:
        assert r["v32_decode_ms"] > 0 and r["mla_decode_ms"] > 0 and r["v32_prefill_s"] > 0
        assert r["v32_kv_bytes"] == 1280 * r["context"] and r["mla_kv_bytes"] == 768 * r["context"]
    assert records["long_context"]["max_num_seqs"] == 8

    b1 = records["batch1"]
    assert b1["output_tokens"] == b1["output_len"] == 12 and b1["decode_tok_s"] > 0
    p = b1["params"]
    assert (p["moe_layers"], p["num_routed_experts"], p["num_experts_per_tok"]) == (1, 8, 2)
    assert b1["weight_bytes_per_token"] == p["active_params"] * 4
    assert b1["stage_engine"] == "w1"

    w1 = records["w1"]
    assert w1["total_output_tokens"] == w1["expected_output_tokens"] > 0
