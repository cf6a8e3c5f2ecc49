"""The Qwen2.5-VL vision tower against transformers' `model.visual` on a tiny random config."""

from __future__ import annotations

import pytest
import torch
import transformers

from shoal.models.vision.qwen2_5_vl import Qwen2_5_VisionTransformer

PATCH_DIM = 3 * 2 * 14 * 14

VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48,
              patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=56,
              fullatt_block_indexes=[1])
TEXT = dict(vocab_size=64, hidden_size=48, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 2, 2],
                             "rope_theta": 10000.0})


@pytest.fixture(scope="module")
def towers() -> tuple[torch.nn.Module, Qwen2_5_VisionTransformer]:
    torch.manual_seed(0)
    config = transformers.Qwen2_5_VLConfig(vision_config=VISION, text_config=TEXT)
    hf = transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()
    visual = hf.model.visual
    with torch.no_grad():
        for p in visual.parameters():
            # large random weights and norms far from 1, so that a wrong permutation,
            # rotary layout or window split shows up well above the tolerance
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
            else:
                p.uniform_(0.5, 1.5)
    ours = Qwen2_5_VisionTransformer(config.vision_config, torch.float32).eval()
    state = visual.state_dict()
    assert ours.load_weights(state.items()) == set(state)
    assert set(dict(ours.named_parameters())) == set(state)
    return visual, ours


def _reference(visual: torch.nn.Module, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    out = visual(pixels, grid_thw=grid)
    return out.pooler_output if hasattr(out, "pooler_output") else out


@pytest.mark.parametrize("grids", [
    [(1, 8, 10)],  # ragged windows, one full-attention segment
    [(1, 8, 8)],  # windows all the same size: the unmasked path
    [(1, 8, 10), (1, 4, 4)],  # two images: ragged full-attention segments
    [(1, 6, 14)],  # patch grid not a multiple of the window
    [(2, 4, 6)],  # a 2-frame video: per-frame full attention
    [(1, 4, 4), (2, 4, 6), (1, 6, 14)],  # all of the above in one call
], ids=["image", "even_windows", "two_images", "odd_grid", "video", "mixed"])
def test_matches_transformers(towers: tuple, grids: list[tuple[int, int, int]]) -> None:
    visual, ours = towers
    grid = torch.tensor(grids, dtype=torch.long)
    pixels = torch.randn(int(grid.prod(-1).sum()), PATCH_DIM)
    with torch.no_grad():
        expected = _reference(visual, pixels, grid)
        got = ours(pixels, grid)
    assert got.shape == (int(grid.prod(-1).sum()) // 4, VISION["out_hidden_size"])
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_bfloat16_tower_tracks_fp32(towers: tuple) -> None:
    _, ours = towers
    half = Qwen2_5_VisionTransformer(transformers.Qwen2_5_VLVisionConfig(**VISION),
                                     torch.bfloat16)
    half.load_weights((n, p.detach()) for n, p in ours.named_parameters())
    grid = torch.tensor([(1, 8, 10), (1, 4, 4)])
    pixels = torch.randn(96, PATCH_DIM, dtype=torch.float64)  # any float dtype is cast
    with torch.no_grad():
        ref = ours(pixels, grid)
        got = half(pixels, grid)
    assert got.dtype == torch.bfloat16
    err = (got.float() - ref).norm() / ref.norm()
    assert err < 5e-2


def test_load_weights_rejects_unknown_and_misshapen(towers: tuple) -> None:
    _, ours = towers
    with pytest.raises(ValueError, match="blocks.9.norm1.weight"):
        ours.load_weights([("blocks.9.norm1.weight", torch.ones(32))])
    with pytest.raises(ValueError, match="merger.ln_q.weight"):
        ours.load_weights([("merger.ln_q.weight", torch.ones(33))])


def test_rejects_mismatched_inputs(towers: tuple) -> None:
    _, ours = towers
    with pytest.raises(ValueError, match="patches"):
        ours(torch.randn(10, PATCH_DIM), torch.tensor([(1, 4, 4)]))
    with pytest.raises(ValueError, match="merge size"):
        ours(torch.randn(15, PATCH_DIM), torch.tensor([(1, 3, 5)]))
