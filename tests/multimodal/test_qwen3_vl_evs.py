"""EVS (video_pruning_rate) for Qwen3-VL videos, whose frame groups are separated by
timestamp text, on the tiny random checkpoint of tests/vl_checkpoints.py.

The oracle is made by hand from transformers' pieces: its tower's output for the video, the
retention mask recomputed here (test_evs.reference_mask), the unpruned prompt (which
test_qwen3_vl_video checks against transformers' processor) with the dropped pads taken out,
and transformers' get_rope_index positions of that unpruned prompt at the kept indices; its
language model (deepstack included) then runs greedily over those inputs_embeds and
position_ids. At rate 0 the same oracle is transformers' own unpruned run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_evs import reference_mask
from test_qwen3_vl_video import VID, Oracle, greedy
from test_video import noise_frames
from vl_checkpoints import write_tiny_qwen3_vl

from shoal import LLM
from shoal.multimodal.video import Video, planned_counts, retained_count

TEXT = f"w1 w2 {VID} w3"
STEPS = 6


def test_planned_counts() -> None:
    assert planned_counts(4, 4, 8) == [4, 2, 1, 1]  # the first frame whole, then spread
    assert planned_counts(4, 4, 16) == [4, 4, 4, 4]
    assert planned_counts(6, 3, 6) == [6, 0, 0]
    assert planned_counts(5, 1, 5) == [5]
    for bad in (3, 17):
        with pytest.raises(ValueError, match="kept must be in"):
            planned_counts(4, 4, bad)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[str, Oracle]:
    folder = write_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_evs"))
    return str(folder), Oracle(folder)


def evs_video() -> Video:
    """8 frames of 64x64: 4 frame groups of 2x2 merged tokens. The second group repeats the
    first, so EVS drops all of it and the kept tokens per frame differ from the plan."""
    frames = noise_frames(21, 8, 64, 64)
    frames[2:4] = frames[0:2]
    return Video(frames, 2.0)


@torch.no_grad()
def hand_made(oracle: Oracle, video: Video, rate: float) -> dict:
    """The pruned prompt, its positions and transformers' greedy tokens over it."""
    oracle.proc.video_pruning_rate = 0.0
    ids, (f,) = oracle.expand(TEXT, [], [video])  # unpruned: transformers' layout
    kw = oracle.inputs(ids, [f])
    hf = oracle.model.model
    positions, _ = hf.get_rope_index(torch.tensor([ids]), kw["mm_token_type_ids"],
                                     image_grid_thw=None, video_grid_thw=kw["video_grid_thw"])
    vis = hf.get_video_features(kw["pixel_values_videos"], kw["video_grid_thw"])
    main, deep = vis.pooler_output[0], [d[0] for d in vis.deepstack_features]
    t = int(kw["video_grid_thw"][0, 0])
    keep = (reference_mask(main, t, len(main) // t, rate) if rate > 0
            else torch.ones(len(main), dtype=torch.bool))
    pad = oracle.config.video_token_id
    pads = np.flatnonzero(np.asarray(ids) == pad)
    columns = np.ones(len(ids), dtype=bool)
    columns[pads[~keep.numpy()]] = False
    kept_ids = torch.tensor(ids)[columns]
    is_pad = kept_ids == pad
    embeds = hf.get_input_embeddings()(kept_ids)
    embeds[is_pad] = main[keep]
    pos = positions[:, 0, columns]
    deepstack = [d[keep] for d in deep]
    tokens = _greedy(oracle.model, embeds, pos, is_pad, deepstack)
    return {"ids": kept_ids.tolist(), "positions": pos, "embeds": embeds, "tokens": tokens,
            "per_frame": keep.reshape(t, -1).sum(1).tolist(), "is_pad": is_pad,
            "deepstack": deepstack}


def _greedy(model, embeds: torch.Tensor, positions: torch.Tensor, is_pad: torch.Tensor,
            deepstack: list[torch.Tensor]) -> list[int]:
    """transformers' Qwen3-VL language model over given rows and 3-D positions, deepstack
    added at the video rows, greedy, recomputed whole each step."""
    lm, head = model.model.language_model, model.lm_head
    x, pos, mask, out = embeds[None], positions[:, None], is_pad[None], []
    for _ in range(STEPS):
        h = lm(inputs_embeds=x, position_ids=pos, visual_pos_masks=mask,
               deepstack_visual_embeds=deepstack).last_hidden_state
        token = int(head(h[0, -1]).argmax())
        out.append(token)
        x = torch.cat([x, model.model.get_input_embeddings()(torch.tensor([[token]]))], 1)
        pos = torch.cat([pos, pos.max() + torch.ones(3, 1, 1, dtype=pos.dtype)], -1)
        mask = torch.cat([mask, torch.zeros(1, 1, dtype=torch.bool)], 1)
    return out


@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_pruned_video_matches_hand_made_transformers(setup, rate) -> None:
    folder, oracle = setup
    video = evs_video()
    want = hand_made(oracle, video, rate)
    per_frame = 4
    kept = retained_count(per_frame, 4, rate)
    assert sum(want["per_frame"]) == kept == 16 * (1 - rate)
    if rate:  # the repeated group is dropped whole: frames keep other counts than planned
        assert want["per_frame"][:2] == [4, 0]
        assert want["per_frame"] != planned_counts(per_frame, 4, kept)
    oracle.proc.video_pruning_rate = rate
    ids, (f,) = oracle.expand(TEXT, [], [video])
    assert len(ids) == len(want["ids"])
    assert ids[:f.offset] == want["ids"][:f.offset] and ids[f.end:] == want["ids"][f.end:]
    if rate:
        assert f.embed_mask is None and f.num_embeds == f.length  # the span takes its rows
        assert ids.count(oracle.config.video_token_id) == kept
    else:  # today's feature: the pads alone, no EVS arrays
        assert ids == want["ids"] and sum(f.embed_mask) == f.num_embeds == 16
        assert set(f.data) == {"pixel_values_videos", "video_grid_thw"}

    # chunks of 8 tokens: the span's rows and positions are read in slices
    llm = LLM(model=folder, dtype="float32", max_model_len=256, max_num_batched_tokens=8,
              video_pruning_rate=rate, num_gpu_blocks_override=256)
    (out,) = llm.generate({"prompt": TEXT, "multi_modal_data": {"video": video}}, greedy(),
                          use_tqdm=False)
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == want["tokens"]
    mm = llm.llm_engine.core.runner.mm
    span = want["positions"][:, f.offset:f.end]
    # every kept token (timestamps included) at its unpruned position
    assert torch.equal(mm.kept_positions[f.identifier] + span[0, 0], span)
    if rate:  # the span's rows: kept tower rows and the texts' embeddings, in their places
        rows = mm.cache[f.identifier][:, :want["embeds"].shape[1]]
        torch.testing.assert_close(rows, want["embeds"][f.offset:f.end], atol=1e-4, rtol=1e-4)
