"""benchmarks/vl_gpu.py (W13, images) at --smoke size on the CPU: every section writes its
record with the figures the H200 run reports; and the shipped Qwen2.5-VL-7B shape it runs
there resolves by name with its image processor and the model card's parameter count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
VL_7B = "Qwen/Qwen2.5-VL-7B-Instruct"


@pytest.mark.gpu_script
def test_vl_gpu_smoke_every_section(tmp_path: Path) -> None:
    out = tmp_path / "vl.json"
    env = {**os.environ, "SHOAL_COMMIT": "test"}
    env.pop("SHOAL_BENCH_PUBLIC_ONLY", None)
    # Every section but EVS (an engine of its own: test time); EVS itself is checked against
    # transformers in tests/multimodal/test_evs.py.
    proc = subprocess.run([sys.executable, "benchmarks/vl_gpu.py", "--smoke", "--sections",
                           "throughput,ttft,encoder,serve", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    recs = {r["workload"]: r for r in json.loads(out.read_text())}
    assert set(recs) == {"W13_throughput", "W13_ttft_cache", "W13_encoder_step", "W13_serve"}
    assert all(r["commit"] == "test" and "error" not in r for r in recs.values())

    tp = recs["W13_throughput"]
    assert tp["num_requests"] == 4 and tp["total_output_tokens"] == 4 * 8
    assert tp["images_per_s"] > 0 and tp["engine_images_per_s"] > 0
    assert len(tp["runs_images_per_s"]) == 2
    assert tp["encoder_counters"] == {"encoded": 4, "hits": 0}  # each image new
    assert tp["image_tokens_per_request"]["median"] > 0

    tt = recs["W13_ttft_cache"]
    assert tt["pairs"] == 2
    for kind in ("new", "hit", "repeat"):
        assert tt[f"{kind}_engine_ms"]["median"] > 0 and tt[f"{kind}_wall_ms"]["p90"] > 0
    # the second sight of an image is an encoder cache hit, not a prefix cache hit
    assert tt["counter_totals"]["new"] == {"encoded": 2, "hits": 0}
    assert tt["counter_totals"]["hit"] == {"encoded": 0, "hits": 2}
    assert all(r["hit"]["cached_tokens"] == 0 < r["repeat"]["cached_tokens"]
               for r in tt["rows"])

    enc = recs["W13_encoder_step"]
    assert enc["embed_multimodal"]["median_ms"] > 0 and enc["eager_tower"]["median_ms"] > 0
    assert enc["eager_tower_per_image_in_batch_ms"] > 0 and enc["tower_tflop_per_image"] > 0
    assert "graph_note" in enc  # no CUDA graphs on the CPU

    sv = recs["W13_serve"]
    assert sv["completed"] == 4 and sv["failed"] == 0 and sv["total_output_tokens"] == 32
    assert sv["over_offline_images_per_s"] > 0 and sv["server_ready_s"] > 0
    # the server renders the chat parts into the very prompts the offline runs sent
    assert sv["prompt_tokens_median"] == sv["offline_prompt_tokens_median"]


def test_shipped_qwen2_5_vl_7b_shape() -> None:
    from shoal.loader import load_model
    from shoal.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
    from shoal.models.registry import resolve_model_class
    from shoal.multimodal.processors.qwen_vl import QwenVLProcessor

    loaded = load_model(VL_7B, load_format="dummy")
    cfg = loaded.hf_config
    assert loaded.tokenizer is None
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == (
        3584, 28, 28, 4, 18944, 152064)
    assert cfg.rope_parameters["mrope_section"] == [16, 24, 24]
    assert cfg.rope_parameters["rope_theta"] == 1e6 and not cfg.tie_word_embeddings
    vis = cfg.multimodal_config.vision_config
    assert (vis.depth, vis.hidden_size, vis.intermediate_size, vis.num_heads,
            vis.out_hidden_size, vis.window_size, vis.fullatt_block_indexes) == (
        32, 1280, 3420, 16, 3584, 112, [7, 15, 23, 31])
    cls = resolve_model_class(cfg)
    assert cls is Qwen2_5_VLForConditionalGeneration
    with torch.device("meta"):
        model = cls(cfg, torch.bfloat16)
    total = sum(p.numel() for p in model.parameters()) / 1e9
    tower = sum(p.numel() for p in model.visual.parameters()) / 1e9
    assert total == pytest.approx(8.29, abs=0.01)  # the model card: 8.29B
    assert tower == pytest.approx(0.68, abs=0.01)
    # a 1024x768 image: 54 x 74 patches of 14, merged 2 x 2 into 999 tokens
    proc = QwenVLProcessor(loaded.source, cfg.multimodal_config, None)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (768, 1024, 3),
                                                            dtype=np.uint8))
    ids, feats = proc.process([1, 151652, 151655, 151653, 2], [img])
    assert feats[0].num_embeds == 999 and len(ids) == 4 + 999
    assert list(feats[0].arrays()["image_grid_thw"]) == [1, 54, 74]
