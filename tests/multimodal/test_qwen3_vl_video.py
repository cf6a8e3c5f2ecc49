"""Qwen3-VL videos against transformers 5.25 on a tiny random checkpoint
(tests/vl_checkpoints.py): frame sampling, the frame-size rule, the patch layout and the
timestamps checked against transformers' own Qwen3-VL processor code (its pieces that run
without torchvision); the prompt's timestamped frame layout against Qwen3VLProcessor's text
replacement; the tower, the per-frame M-RoPE positions, and the engine's greedy tokens and
logprobs against transformers' generate on the same pixels (a video alone, chunked through
it, and beside an image); a video_url chat part giving the offline tokens."""

from __future__ import annotations

import functools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from test_video import data_url, mp4, noise_frames
from vl_checkpoints import image, write_tiny_qwen3_vl

from shoal import LLM, SamplingParams
from shoal.multimodal.media import MediaSettings
from shoal.multimodal.processors.qwen3_vl import group_times, video_size
from shoal.multimodal.video import Video, load_video

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
VID = "<|vision_start|><|video_pad|><|vision_end|>"
STEPS = 6


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_qwen3_vl(tmp_path_factory.mktemp("qwen3_vl_video"))


class Oracle:
    def __init__(self, folder: Path):
        from transformers import AutoConfig, AutoTokenizer, Qwen3VLForConditionalGeneration

        from shoal.multimodal.processors.qwen3_vl import Qwen3VLProcessor

        self.model = Qwen3VLForConditionalGeneration.from_pretrained(
            folder, dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(str(folder))
        self.config = AutoConfig.from_pretrained(folder)
        self.proc = Qwen3VLProcessor(folder, self.config, self.tok)

    def expand(self, text: str, images: list, videos: list) -> tuple[list[int], list]:
        return self.proc.process(self.tok.encode(text, add_special_tokens=False), images,
                                 videos)

    def inputs(self, ids: list[int], feats: list) -> dict[str, torch.Tensor]:
        kw: dict[str, torch.Tensor] = {}
        for kind, pixels, grid in (("image", "pixel_values", "image_grid_thw"),
                                   ("video", "pixel_values_videos", "video_grid_thw")):
            arrays = [f.arrays() for f in feats if f.modality == kind]
            if arrays:
                kw[pixels] = torch.cat([torch.tensor(a[pixels]) for a in arrays])
                kw[grid] = torch.stack([torch.tensor(a[grid]).reshape(3) for a in arrays])
        x = torch.tensor([ids])
        kw["mm_token_type_ids"] = ((x == self.config.image_token_id).int()
                                   + 2 * (x == self.config.video_token_id).int())
        return kw

    @torch.no_grad()
    def run(self, text: str, images: list, videos: list
            ) -> tuple[list[int], list[int], list[float]]:
        """(expanded prompt, greedy tokens, each token's logprob) of transformers."""
        ids, feats = self.expand(text, images, videos)
        kw = self.inputs(ids, feats)
        x = torch.tensor([ids])
        out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                  max_new_tokens=STEPS, do_sample=False, **kw)
        tokens = out[0, len(ids):].tolist()
        full = torch.tensor([ids + tokens[:-1]])
        types = torch.zeros_like(full, dtype=torch.int)
        types[:, :len(ids)] = kw.pop("mm_token_type_ids")
        logits = self.model(input_ids=full, mm_token_type_ids=types, **kw).logits[0]
        lps = torch.log_softmax(logits[len(ids) - 1:].float(), -1)
        return ids, tokens, [float(lps[i, t]) for i, t in enumerate(tokens)]


@pytest.fixture(scope="module")
def oracle(folder) -> Oracle:
    return Oracle(folder)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    # 512 blocks: the CPU default (4 GiB) is ~500k block objects, ~1.3 s an engine
    return LLM(model=str(folder), dtype="float32", max_model_len=512,
               num_gpu_blocks_override=512, limit_mm_per_prompt={"image": 1, "video": 2})


# ---- the processor against transformers' pieces --------------------------------------------

@pytest.mark.parametrize("total, fps", [(40, 10.0), (7, 30.0), (300, 25.0), (9, 2.0)])
def test_frame_sampling_is_transformers(oracle, total, fps) -> None:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    meta = VideoMetadata(total_num_frames=total, fps=fps)
    want = Qwen3VLVideoProcessor().sample_frames(meta).tolist()
    assert oracle.proc.sample_frames(total, fps, 768) == want


@pytest.mark.parametrize("t, h, w", [(4, 64, 64), (6, 64, 96), (2, 20, 300), (9, 200, 130)])
def test_frame_size_is_transformers(t, h, w) -> None:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

    want = smart_resize(t, h, w, temporal_factor=2, factor=32, min_pixels=1024,
                        max_pixels=8 * 64 * 64)
    assert video_size(t, h, w, 2, 32, 1024, 8 * 64 * 64) == want


def test_one_frame_is_refused(oracle) -> None:
    with pytest.raises(ValueError, match="at least 2 frames"):
        oracle.expand(f"w1 {VID}", [], [Video(noise_frames(0, 1, 64, 64), 2.0)])


@pytest.mark.parametrize("frames", [4, 5])
def test_patches_and_timestamps_are_transformers(oracle, frames) -> None:
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    video = Video(noise_frames(1, frames, 64, 96), 4.0)  # within the pixel budget: no resize
    ids, (f,) = oracle.expand(f"w1 {VID} w2", [], [video])
    a = f.arrays()
    x = torch.tensor(video.frames).permute(0, 3, 1, 2)[None].float() / 255
    x = (x - 0.5) / 0.5
    want, *grid = Qwen3VLVideoProcessor.patchify(Qwen3VLVideoProcessor(), x, 16, 2, 2)
    assert a["video_grid_thw"].tolist() == grid
    np.testing.assert_allclose(a["pixel_values_videos"], want[0].numpy(), atol=1e-6)
    stamps = Qwen3VLProcessor._calculate_timestamps(None, list(range(frames)), 4.0, 2)
    assert group_times(video.frame_times(), 2) == pytest.approx(stamps)


def _transformers_prompt(oracle, text: str, video: Video, grid: list[int]) -> list[int]:
    """The prompt transformers' Qwen3VLProcessor writes for one video (its replace_video_token
    and wrapper collapse), tokenized."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    ns = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
        vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
        video_token="<|video_pad|>",
        _calculate_timestamps=functools.partial(Qwen3VLProcessor._calculate_timestamps, None))
    meta = VideoMetadata(total_num_frames=video.num_frames, fps=video.fps,
                         frames_indices=list(range(video.num_frames)))
    layout = Qwen3VLProcessor.replace_video_token(
        ns, {"video_grid_thw": [torch.tensor(grid)], "video_metadata": [meta]}, 0)
    text = text.replace(VID, "<|video_pad|>").replace("<|video_pad|>", layout)
    return oracle.tok.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", [f"w1 w2 {VID} w3", "w1 <|video_pad|> w3"],
                         ids=["wrapped", "bare"])
def test_prompt_layout_is_transformers(oracle, text) -> None:
    video = Video(noise_frames(2, 6, 64, 64), 2.0)
    ids, (f,) = oracle.expand(text, [], [video])
    assert ids == _transformers_prompt(oracle, text, video, f.arrays()["video_grid_thw"].tolist())
    pad = oracle.config.video_token_id
    assert sum(f.embed_mask) == ids.count(pad) == f.num_embeds == 3 * 4
    assert ids[f.offset] == pad and ids[f.end - 1] == pad
    assert "seconds>" in oracle.tok.convert_ids_to_tokens(ids)


# ---- the model against transformers ---------------------------------------------------------

def test_tower_and_positions_match_transformers(oracle, llm) -> None:
    model = llm.llm_engine.core.runner.model
    video, im = Video(noise_frames(3, 6, 64, 96), 3.0), image(4, 96, 64)
    ids, feats = oracle.expand(f"w1 {IMG} w2 {VID} w3 w4", [im], [video])
    a = feats[1].arrays()
    with torch.no_grad():
        got = model.embed_multimodal([feats[1]])[0]
        ref = oracle.model.model.get_video_features(torch.tensor(a["pixel_values_videos"]),
                                                    torch.tensor(a["video_grid_thw"])[None])
    want = torch.cat([ref.pooler_output[0], *(d[0] for d in ref.deepstack_features)], -1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    kw = oracle.inputs(ids, feats)
    pos, delta = model.get_mrope_positions(ids, feats)
    ref_pos, ref_delta = oracle.model.model.get_rope_index(
        torch.tensor([ids]), kw["mm_token_type_ids"], image_grid_thw=kw["image_grid_thw"],
        video_grid_thw=kw["video_grid_thw"])
    assert torch.equal(pos, ref_pos[:, 0]) and delta == int(ref_delta)


def _check(out: Any, want: tuple[list[int], list[int], list[float]]) -> None:
    ids, tokens, lps = want
    assert out.prompt_token_ids == ids
    got = out.outputs[0]
    assert list(got.token_ids) == tokens
    for step, tok in enumerate(tokens):
        assert got.logprobs[step][tok].logprob == pytest.approx(lps[step], abs=1e-4)


def test_video_matches_transformers(llm, oracle) -> None:
    video = Video(noise_frames(5, 6, 64, 96), 2.0)  # resized to fit the budget
    text = f"w1 w2 {VID} w3"
    (out,) = llm.generate({"prompt": text, "multi_modal_data": {"video": video}}, greedy(),
                          use_tqdm=False)
    _check(out, oracle.run(text, [], [video]))


def test_image_and_video_and_chunked_prefill(folder, llm, oracle) -> None:
    video, im = Video(noise_frames(6, 4, 64, 64), 1.0), image(7, 96, 64)
    text = f"w4 {IMG} w5 {VID} w6"
    want = oracle.run(text, [im], [video])
    prompt = {"prompt": text, "multi_modal_data": {"image": im, "video": [video]}}
    (out,) = llm.generate(prompt, greedy(), use_tqdm=False)
    _check(out, want)
    small = LLM(model=str(folder), dtype="float32", max_model_len=512,
                max_num_batched_tokens=8, num_gpu_blocks_override=512)
    (out,) = small.generate(prompt, greedy(), use_tqdm=False)
    _check(out, want)
    single = {"prompt": f"w7 {VID} w8 w9", "multi_modal_data": {"video": video}}
    (out,) = small.generate(single, greedy(), use_tqdm=False)
    _check(out, oracle.run(single["prompt"], [], [video]))


def test_video_url_chat_part_gives_the_offline_tokens(llm, oracle) -> None:
    data = mp4(noise_frames(8, 20, 64, 64), 10)  # 2 s at 10 fps: 4 frames sampled
    video = load_video(data_url(data), MediaSettings(), oracle.proc.sample_frames)
    assert video.num_frames == 4
    assert video.times == pytest.approx((0.0, 0.6, 1.3, 1.9))  # frames 0, 6, 13, 19
    parts = [{"type": "video_url", "video_url": {"url": data_url(data)}},
             {"type": "text", "text": "w3 w4"}]
    (chat,) = llm.chat([{"role": "user", "content": parts}], greedy(), use_tqdm=False)
    text = f"<|im_start|>user\n{VID}\nw3 w4<|im_end|>\n<|im_start|>assistant\n"
    (offline,) = llm.generate({"prompt": text, "multi_modal_data": {"video": video}},
                              greedy(), use_tqdm=False)
    assert chat.prompt_token_ids == offline.prompt_token_ids
    _check(chat, oracle.run(text, [], [video]))

