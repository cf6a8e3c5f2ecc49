"""The shipped Qwen3-VL-8B-Instruct shape (shoal/model_configs/qwen3-vl-8b): it resolves by
name, builds on the meta device with the model card's parameter count, and its image and video
preprocessor configs load without a tokenizer download: the image processor through
transformers, the video settings through shoal's reader (transformers' video processor needs
torchvision), giving the token counts benchmarks/vl_gpu.py's EVS section reports."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from vl_checkpoints import QWEN_SPECIALS, TIMESTAMP_WORDS, word_tokenizer

VL_8B = "Qwen/Qwen3-VL-8B-Instruct"


@pytest.fixture(scope="module")
def loaded():
    from shoal.loader import load_model

    return load_model(VL_8B, load_format="dummy")


def test_config_fields(loaded) -> None:
    cfg = loaded.hf_config
    assert loaded.tokenizer is None and Path(loaded.source).name == "qwen3-vl-8b"
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size) == (
        4096, 36, 32, 8, 128, 12288, 151936)
    assert cfg.rope_parameters == {"rope_type": "default", "mrope_section": [24, 20, 20],
                                   "mrope_interleaved": True, "rope_theta": 5e6}
    assert cfg.max_position_embeddings == 262144 and not cfg.tie_word_embeddings
    mm = cfg.multimodal_config
    assert (mm.image_token_id, mm.video_token_id, mm.vision_start_token_id,
            mm.vision_end_token_id) == (151655, 151656, 151652, 151653)
    vis = mm.vision_config
    assert (vis.depth, vis.hidden_size, vis.intermediate_size, vis.num_heads, vis.patch_size,
            vis.out_hidden_size, vis.num_position_embeddings, vis.hidden_act) == (
        27, 1152, 4304, 16, 16, 4096, 2304, "gelu_pytorch_tanh")
    assert list(vis.deepstack_visual_indexes) == [8, 16, 24]


def test_builds_on_meta_with_the_model_cards_count(loaded) -> None:
    from shoal.models.qwen3_vl import Qwen3VLForConditionalGeneration
    from shoal.models.registry import resolve_model_class

    cls = resolve_model_class(loaded.hf_config)
    assert cls is Qwen3VLForConditionalGeneration
    with torch.device("meta"):
        model = cls(loaded.hf_config, torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for p in model.visual.parameters())
    assert total == 8_767_123_696  # 8.77B, as public model cards list it
    assert tower == 576_388_336
    assert model.num_deepstack == 3


def test_processor_files_load(loaded) -> None:
    from shoal.multimodal.processors.qwen3_vl import Qwen3VLProcessor, VideoConfig
    from shoal.multimodal.video import Video

    video = VideoConfig.load(loaded.source)
    assert (video.min_pixels, video.max_pixels, video.patch_size, video.fps,
            video.image_mean) == (4096, 25165824, 16, 2.0, (0.5, 0.5, 0.5))
    tok, _ = word_tokenizer(QWEN_SPECIALS, extra=TIMESTAMP_WORDS)  # timestamps only
    proc = Qwen3VLProcessor(loaded.source, loaded.hf_config.multimodal_config, tok)
    ip = proc.image_processor
    assert (ip.size.shortest_edge, ip.size.longest_edge, ip.patch_size, ip.merge_size) == (
        65536, 16777216, 16, 2)
    # a 1024x768 image: 48 x 64 patches of 16, merged 2 x 2 into 768 tokens
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (768, 1024, 3),
                                                            dtype=np.uint8))
    ids, feats = proc.process([1, 151652, 151655, 151653, 2], [img])
    assert feats[0].num_embeds == 768 and len(ids) == 4 + 768
    assert list(feats[0].arrays()["image_grid_thw"]) == [1, 48, 64]
    # vl_gpu.py's EVS video: 16 frames of 640x480 at 2 fps, 8 groups of 15 x 20 tokens;
    # half of them at video_pruning_rate 0.5 (the tower still encodes all)
    frames = np.zeros((16, 480, 640, 3), dtype=np.uint8)
    for rate, pads in ((0.0, 2400), (0.5, 1200)):
        proc.video_pruning_rate = rate
        ids, feats = proc.process([1, 151652, 151656, 151653, 2], [], [Video(frames, 2.0)])
        assert ids.count(151656) == pads
        assert list(feats[0].arrays()["video_grid_thw"]) == [8, 30, 40]
