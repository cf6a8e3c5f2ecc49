"""Videos for Qwen2.5-VL: PyAV decoding and sampling at 2 fps (hostile files refused), the
processor's patches against transformers' image processor, and the whole engine against
transformers on a tiny random checkpoint (tests/vl_checkpoints.py).

transformers 5.25 starts the text after a video at its largest row or column position;
Qwen's own rule (and vLLM's, and shoal's) starts it past the video's largest position,
time included. The generate() oracle uses videos whose time positions stay below their
rows and columns, where the two agree; a time-scaled video is checked against a greedy loop
over transformers' language model fed the reference positions."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from vl_checkpoints import image, write_tiny_qwen2_5_vl

from shoal import LLM, SamplingParams
from shoal.multimodal.media import MediaError, MediaSettings
from shoal.multimodal.video import Video, decode_video, load_video

IMG = "<|vision_start|><|image_pad|><|vision_end|>"
VID = "<|vision_start|><|video_pad|><|vision_end|>"
MAX_TOKENS = 6


def noise_frames(seed: int, n: int, height: int, width: int) -> np.ndarray:
    return (np.random.RandomState(seed).rand(n, height, width, 3) * 255).astype(np.uint8)


def mp4(frames: np.ndarray, fps: int) -> bytes:
    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        for f in frames:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def data_url(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


class Oracle:
    def __init__(self, folder: Path):
        from transformers import AutoConfig, AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        from shoal.multimodal.processors.qwen_vl import QwenVLProcessor

        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            folder, dtype=torch.float32).eval()
        self.tok = AutoTokenizer.from_pretrained(str(folder))
        self.config = AutoConfig.from_pretrained(folder)
        self.proc = QwenVLProcessor(folder, self.config, self.tok)

    def expand(self, text: str, images: list, videos: list) -> tuple[list[int], list]:
        return self.proc.process(self.tok.encode(text, add_special_tokens=False), images,
                                 videos)

    @torch.no_grad()
    def generate(self, text: str, images: list, videos: list) -> tuple[list[int], list[int]]:
        ids, feats = self.expand(text, images, videos)
        x = torch.tensor([ids])
        kw: dict = {}
        a_img = [f.arrays() for f in feats if f.modality == "image"]
        a_vid = [f.arrays() for f in feats if f.modality == "video"]
        if a_img:
            kw["pixel_values"] = torch.cat([torch.tensor(a["pixel_values"]) for a in a_img])
            kw["image_grid_thw"] = torch.stack([torch.tensor(a["image_grid_thw"])
                                                for a in a_img])
        if a_vid:
            kw["pixel_values_videos"] = torch.cat([torch.tensor(a["pixel_values_videos"])
                                                   for a in a_vid])
            kw["video_grid_thw"] = torch.stack([torch.tensor(a["video_grid_thw"])
                                                for a in a_vid])
            kw["second_per_grid_ts"] = torch.tensor([a["second_per_grid_t"][0]
                                                     for a in a_vid])
        types = ((x == self.config.image_token_id).long()
                 + 2 * (x == self.config.video_token_id).long())
        out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x),
                                  max_new_tokens=MAX_TOKENS, do_sample=False,
                                  mm_token_type_ids=types, **kw)
        return ids, out[0, len(ids):].tolist()


def reference_positions(ids: list[int], spans: list[tuple[int, np.ndarray]]) -> np.ndarray:
    """Qwen's get_rope_index: text counts on from the largest position before it; a span
    of vision tokens takes its (t, h, w) grid [3, n] after the text before it."""
    cols, nxt, i = [], 0, 0
    starts = dict(spans)
    while i < len(ids):
        if i in starts:
            grid = starts[i] + nxt
            cols.append(grid)
            nxt, i = int(grid.max()) + 1, i + grid.shape[1]
        else:
            cols.append(np.full((3, 1), nxt))
            nxt, i = nxt + 1, i + 1
    return np.concatenate(cols, axis=1)


@torch.no_grad()
def greedy_loop(model, ids: list[int], embeds: torch.Tensor, positions: np.ndarray,
                steps: int = MAX_TOKENS) -> list[int]:
    """transformers' language model over given input embeddings and 3-D positions, greedy,
    recomputed whole each step (text tokens after the prompt count on from its largest)."""
    lm, head = model.model.language_model, model.lm_head
    pos = torch.tensor(positions).unsqueeze(1)
    x, out = embeds.unsqueeze(0), []
    for _ in range(steps):
        h = lm(inputs_embeds=x, position_ids=pos).last_hidden_state
        token = int(head(h[0, -1]).argmax())
        out.append(token)
        x = torch.cat([x, model.model.get_input_embeddings()(torch.tensor([[token]]))], 1)
        pos = torch.cat([pos, pos.max() + torch.ones(3, 1, 1, dtype=pos.dtype)], -1)
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl_video"))


@pytest.fixture(scope="module")
def oracle(folder) -> Oracle:
    return Oracle(folder)


@pytest.fixture(scope="module")
def llm(folder) -> LLM:
    # 512 blocks: the CPU default (4 GiB) is ~500k block objects, ~1.3 s an engine
    return LLM(model=str(folder), dtype="float32", max_model_len=640,
               max_num_batched_tokens=640, limit_mm_per_prompt={"image": 2, "video": 2},
               num_gpu_blocks_override=512)


# ---- decoding ------------------------------------------------------------------------------

def test_decoder_samples_at_the_target_fps() -> None:
    frames = noise_frames(0, 20, 48, 64)  # 2 s at 10 fps
    video = decode_video(mp4(frames, 10), MediaSettings())
    assert video.frames.shape == (4, 48, 64, 3) and video.frames.dtype == np.uint8
    assert video.fps == pytest.approx(2.0)
    capped = decode_video(mp4(frames, 10), MediaSettings(max_video_frames=3))
    assert capped.num_frames == 3
    loaded = load_video(data_url(mp4(frames, 10)), MediaSettings())
    np.testing.assert_array_equal(loaded.frames, video.frames)


def _png() -> bytes:
    buf = io.BytesIO()
    image(1, 32, 32).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("make, settings, message", [
    (lambda: b"\x00" * 4096, MediaSettings(), "could not decode"),
    (_png, MediaSettings(), "not accepted|could not decode"),
    (lambda: mp4(noise_frames(1, 12, 32, 32), 4)[:3000], MediaSettings(),
     "could not decode|truncated"),
    (lambda: mp4(noise_frames(2, 12, 32, 32), 4), MediaSettings(max_video_source_frames=8),
     "over the limit of 8"),
    (lambda: mp4(noise_frames(3, 4, 64, 64), 4), MediaSettings(max_image_pixels=1000),
     "pixels"),
], ids=["not-a-video", "an-image", "truncated", "too-many-frames", "too-many-pixels"])
def test_hostile_videos_are_refused(make, settings, message) -> None:
    with pytest.raises(MediaError, match=message):
        load_video(data_url(make()), settings)


def test_video_url_rules() -> None:
    with pytest.raises(MediaError, match="not a video"):
        load_video(data_url(b"abc", "image/png"), MediaSettings())
    with pytest.raises(MediaError, match="not allowed"):
        load_video("https://example.com/a.mp4", MediaSettings())
    with pytest.raises(MediaError, match="over the limit"):
        load_video(data_url(b"\x00" * 4000), MediaSettings(max_video_bytes=1000))


# ---- processing ----------------------------------------------------------------------------

def test_a_frame_twice_gives_the_image_rows(oracle) -> None:
    im = image(3, 100, 130)
    want = oracle.proc.image_processor(images=[im], return_tensors="np")
    f = np.asarray(im)
    for frames in (np.stack([f, f]), f[None]):  # one frame: repeated to fill the group
        pixels, grid = oracle.proc.video_pixels_of(frames)
        assert grid.tolist() == want["image_grid_thw"][0].tolist()
        np.testing.assert_allclose(pixels, want["pixel_values"], rtol=0, atol=1e-6)


def test_video_placeholder_expands_to_merged_patches(oracle) -> None:
    ids, (f,) = oracle.expand(f"w1 {VID} w2", [], [Video(noise_frames(4, 8, 56, 84), 2.0)])
    t, h, w = f.arrays()["video_grid_thw"].tolist()
    assert (t, h, w) == (4, 4, 6) and f.modality == "video"
    assert ids.count(oracle.config.video_token_id) == f.length == t * h * w // 4
    assert f.arrays()["second_per_grid_t"][0] == pytest.approx(1.0)


# ---- the engine against transformers -------------------------------------------------------

def test_video_matches_transformers(llm, oracle) -> None:
    # 8 fps: time positions 0..3 stay below the 8 rows, where transformers agrees with Qwen
    video = Video(noise_frames(5, 8, 224, 224), 8.0)
    text = f"w1 w2 {VID} w3"
    (out,) = llm.generate({"prompt": text, "multi_modal_data": {"video": video}}, greedy(),
                          use_tqdm=False)
    ids, tokens = oracle.generate(text, [], [video])
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == tokens


def test_image_and_video_in_one_prompt(llm, oracle) -> None:
    video, im = Video(noise_frames(6, 6, 112, 168), 6.0), image(7, 100, 130)
    text = f"w4 {VID} w5 {IMG} w6"
    (out,) = llm.generate({"prompt": text, "multi_modal_data": {"image": [im],
                                                               "video": [video]}},
                          greedy(), use_tqdm=False)
    ids, tokens = oracle.generate(text, [im], [video])
    assert out.prompt_token_ids == ids
    assert list(out.outputs[0].token_ids) == tokens


def _time_scaled_reference(oracle, text: str, video: Video) -> tuple[list[int], list[int]]:
    ids, (f,) = oracle.expand(text, [], [video])
    a = f.arrays()
    with torch.no_grad():
        vis = oracle.model.model.get_video_features(
            torch.tensor(a["pixel_values_videos"]),
            torch.tensor(a["video_grid_thw"])[None]).pooler_output[0]
        embeds = oracle.model.model.get_input_embeddings()(torch.tensor(ids))
    embeds[f.offset:f.end] = vis
    t, h, w = a["video_grid_thw"].tolist()
    step = 4 * a["second_per_grid_t"][0]  # tokens_per_second of the tiny config
    tt, hh, ww = np.meshgrid(np.arange(t) * step, np.arange(h // 2), np.arange(w // 2),
                             indexing="ij")
    grid = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]).astype(np.int64)
    return ids, greedy_loop(oracle.model, ids, embeds, reference_positions(ids, [(f.offset,
                                                                                  grid)]))


def test_time_scaled_video_and_chunked_prefill(folder, llm, oracle) -> None:
    """2 fps: time positions 0, 4, 8, 12 pass the rows; also in 8-token steps."""
    data = mp4(noise_frames(8, 16, 56, 56), 4)  # 4 s at 4 fps -> 8 frames at 2 fps
    video = load_video(data_url(data), MediaSettings())
    assert video.num_frames == 8
    text = f"w7 {VID} w8 w9"
    ids, tokens = _time_scaled_reference(oracle, text, video)
    small = LLM(model=str(folder), dtype="float32", max_model_len=256,
                max_num_batched_tokens=8, num_gpu_blocks_override=512)
    for engine in (llm, small):
        (out,) = engine.generate({"prompt": text, "multi_modal_data": {"video": video}},
                                 greedy(), use_tqdm=False)
        assert out.prompt_token_ids == ids
        assert list(out.outputs[0].token_ids) == tokens


def test_video_limits_and_bad_videos(llm) -> None:
    one = Video(noise_frames(9, 2, 56, 56), 2.0)
    with pytest.raises(ValueError, match=r"at most 2 video\(s\)"):
        llm.generate({"prompt": f"{VID} {VID} {VID}",
                      "multi_modal_data": {"video": [one, one, one]}}, greedy())
    with pytest.raises(ValueError, match="uint8 array"):
        llm.generate({"prompt": VID, "multi_modal_data": {"video": np.zeros((2, 8, 8))}},
                     greedy())
    with pytest.raises(ValueError, match=r"placeholders for 1 video"):
        llm.generate({"prompt": "w1", "multi_modal_data": {"video": one}}, greedy())
