"""EVS (video_pruning_rate) for Qwen2.5-VL: the kept count (vLLM's rule), the first frame
whole, kept tokens at their unpruned (t, h, w) positions, and the engine's greedy tokens
equal to transformers' language model fed the same pruned embeddings and positions (the
mask recomputed here from transformers' own tower output)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_video import VID, greedy, greedy_loop, noise_frames, reference_positions
from vl_checkpoints import write_tiny_qwen2_5_vl

from shoal import LLM
from shoal.engine.engine_args import EngineArgs
from shoal.models.qwen2_5_vl import evs_keep_mask
from shoal.multimodal.video import Video, retained_count


def reference_mask(embeds: torch.Tensor, t: int, hw: int, rate: float) -> torch.Tensor:
    x = embeds.reshape(t, hw, -1)
    sim = torch.nn.functional.cosine_similarity(x[1:], x[:-1], dim=-1)
    score = torch.cat([torch.full((1, hw), 255.0), 1 - sim]).reshape(-1)
    keep = torch.zeros(t * hw, dtype=torch.bool)
    keep[torch.argsort(score, descending=True, stable=True)[:retained_count(hw, t, rate)]] = 1
    return keep


def test_retained_count_and_mask() -> None:
    assert retained_count(16, 4, 0.0) == 64
    assert retained_count(16, 4, 0.5) == 32
    assert retained_count(16, 4, 0.3) == int(64 * 0.7)
    assert retained_count(16, 4, 0.99) == 16  # never below the first frame
    embeds = torch.randn(4 * 6, 8)
    embeds[6:12] = embeds[:6] + 0.01  # frame 1 repeats frame 0: its tokens go first
    keep = evs_keep_mask(embeds, (4, 2, 3), 0.5)
    assert int(keep.sum()) == 12 and bool(keep[:6].all()) and not bool(keep[6:12].any())
    assert torch.equal(keep, reference_mask(embeds, 4, 6, 0.5))


def test_rate_is_validated() -> None:
    for bad in (1.0, -0.1, "0.5"):
        with pytest.raises(ValueError, match="video_pruning_rate"):
            EngineArgs(model="x", video_pruning_rate=bad)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from test_video import Oracle

    folder = write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl_evs"))
    return folder, Oracle(folder)


def reference(oracle, ids: list[int], f, rate: float) -> tuple[list[int], np.ndarray]:
    """Greedy tokens of transformers over the pruned video, and the kept positions."""
    a = f.arrays()
    t, h, w = (int(x) for x in a["video_grid_thw"])
    with torch.no_grad():
        vis = oracle.model.model.get_video_features(
            torch.tensor(a["pixel_values_videos"]),
            torch.tensor(a["video_grid_thw"])[None]).pooler_output[0]
        embeds = oracle.model.model.get_input_embeddings()(torch.tensor(ids))
    keep = reference_mask(vis, t, h * w // 4, rate) if rate > 0 else torch.ones(len(vis), dtype=torch.bool)
    embeds[f.offset:f.end] = vis[keep]
    step = 4 * a["second_per_grid_t"][0]  # tokens_per_second of the tiny config
    tt, hh, ww = np.meshgrid((np.arange(t) * step).astype(np.int64), np.arange(h // 2),
                             np.arange(w // 2), indexing="ij")
    grid = np.stack([tt.ravel(), hh.ravel(), ww.ravel()])
    kept = grid[:, keep.numpy()]
    # the text after the video counts on from the whole grid's largest position
    positions = reference_positions(ids, [(f.offset, kept)])
    positions[:, f.end:] += int(grid.max()) - int(kept.max())
    return greedy_loop(oracle.model, ids, embeds, positions), kept


@pytest.mark.parametrize("rate", [0.0, 0.5, 0.75])
def test_pruned_video_matches_transformers(setup, rate) -> None:
    folder, oracle = setup
    # a static half: later frames repeat the first in the top rows, so pruning drops them
    frames = noise_frames(11, 8, 112, 112)
    frames[:, :56] = frames[0, :56]
    video = Video(frames, 2.0)
    llm = LLM(model=str(folder), dtype="float32", max_model_len=512,
              max_num_batched_tokens=64, video_pruning_rate=rate,
              num_gpu_blocks_override=512)  # CPU default: 4 GiB, ~500k blocks, ~1.3 s
    text = f"w1 {VID} w2 w3"
    oracle.proc.video_pruning_rate = rate
    ids, (f,) = oracle.expand(text, [], [video])
    assert f.length == retained_count(16, 4, rate)
    tokens, kept = reference(oracle, ids, f, rate)
    (out,) = llm.generate({"prompt": text, "multi_modal_data": {"video": video}}, greedy(),
                          use_tqdm=False)
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == tokens
    mm = llm.llm_engine.core.runner.mm
    rel = mm.kept_positions[f.identifier]
    # the unpruned positions at the kept indices (relative: the video starts at 0)
    np.testing.assert_array_equal(rel.numpy(), kept)
    assert rel.shape[1] == f.length and (rel[0, :16] == 0).all()  # the first frame whole
