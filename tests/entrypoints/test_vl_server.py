"""`shoal serve` over a tiny random Qwen2.5-VL: chat image parts as data URLs give
transformers' greedy tokens and the offline LLM.chat's, streamed or not; hostile media (a
non-image, a truncated image, a huge one, a decompression bomb, SSRF-style and local-file
URLs, too many images, malformed parts) each answered 400 naming the problem, with the
server serving the next request."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib

import pytest
import torch
from vl_checkpoints import hf_greedy, image, write_tiny_qwen2_5_vl

from .conftest import RemoteServer

pytestmark = pytest.mark.slow

STEPS = 6
TEXT = "w5 w6 w7"


def png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def claimed_size_png(width: int, height: int) -> bytes:
    """A tiny PNG whose header claims width x height (CRC fixed up)."""
    data = bytearray(png_bytes(image(9, 4, 4)))
    ihdr = 8 + 8  # signature, then the IHDR chunk's length and type
    data[ihdr:ihdr + 8] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr - 4:ihdr + 13]))
    data[ihdr + 13:ihdr + 17] = struct.pack(">I", crc)
    return bytes(data)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl-server")
    folder = write_tiny_qwen2_5_vl(root / "model")
    media = root / "media"
    media.mkdir()
    (media / "ok.png").write_bytes(png_bytes(image(3, 60, 50)))
    srv = RemoteServer(str(folder), "--dtype", "float32", "--allowed-local-media-path",
                       str(media), "--limit-mm-per-prompt", '{"image": 2}',
                       base_args=["--kv-cache-memory-bytes", str(32 << 20),
                                  "--max-model-len", "512"])
    yield srv, folder, media
    srv.stop()


def _chat(srv, parts: list, stream: bool = False, **kw):
    body = {"model": srv.get("/v1/models").json()["data"][0]["id"],
            "messages": [{"role": "user", "content": parts}], "max_tokens": STEPS,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, **kw}
    return srv.post("/v1/chat/completions", json=body)


def _oracle(folder, prompt_ids: list[int], images: list) -> list[int]:
    from transformers import AutoImageProcessor, Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    out = AutoImageProcessor.from_pretrained(folder)(images=images, return_tensors="pt")
    pad = model.config.image_token_id
    kinds = (torch.tensor([prompt_ids]) == pad).int()
    return hf_greedy(model.eval(), prompt_ids, STEPS, pixel_values=out["pixel_values"],
                     image_grid_thw=out["image_grid_thw"], mm_token_type_ids=kinds)


def test_data_url_chat_gives_transformers_and_offline_tokens(setup) -> None:
    srv, folder, _ = setup
    img = image(1, 90, 70)
    client = srv.openai()
    parts = [{"type": "image_url", "image_url": {"url": data_url(png_bytes(img))}},
             {"type": "text", "text": TEXT}]
    resp = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=[{"role": "user", "content": parts}],
        max_tokens=STEPS, temperature=0, extra_body={"ignore_eos": True,
                                                     "return_token_ids": True})
    extra = resp.model_extra or {}
    prompt_ids = extra["prompt_token_ids"]
    tokens = resp.choices[0].model_extra["token_ids"]
    assert _oracle(folder, prompt_ids, [img]) == tokens

    from shoal import LLM, SamplingParams

    llm = LLM(model=str(folder), dtype="float32", max_model_len=512,
              kv_cache_memory_bytes=16 << 20)
    offline = llm.chat([{"role": "user", "content": parts}],
                       SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True),
                       use_tqdm=False)[0]
    assert list(offline.prompt_token_ids) == prompt_ids
    assert list(offline.outputs[0].token_ids) == tokens


def test_stream_and_local_file_match(setup) -> None:
    srv, folder, media = setup
    url = f"file://{media / 'ok.png'}"
    r = _chat(srv, [{"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": TEXT}])
    assert r.status_code == 200, r.text
    whole = r.json()["choices"][0]["token_ids"]
    body = {"model": srv.get("/v1/models").json()["data"][0]["id"], "stream": True,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": url}},
                {"type": "text", "text": TEXT}]}],
            "max_tokens": STEPS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    streamed: list[int] = []
    resp = srv.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    for line in resp.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:]).get("choices", []):
                streamed.extend(c.get("token_ids") or [])
    assert streamed == whole


BOMB = claimed_size_png(20000, 20000)
HOSTILE = {
    "not an image": ([{"type": "image_url", "image_url": {"url": data_url(b"hello world")}}],
                     "decode"),
    "text mime": ([{"type": "image_url", "image_url": {
        "url": data_url(b"hello", "text/plain")}}], "image"),
    "truncated": ([{"type": "image_url", "image_url": {
        "url": data_url(png_bytes(image(2, 64, 64))[:200])}}], "decode"),
    "20000 x 20000": ([{"type": "image_url", "image_url": {"url": data_url(BOMB)}}], "pixels"),
    "over our limit": ([{"type": "image_url", "image_url": {
        "url": data_url(claimed_size_png(9000, 9000))}}], "pixels"),
    "ssrf metadata": ([{"type": "image_url", "image_url": {
        "url": "http://169.254.169.254/latest/meta-data"}}], "allowed-media-domains"),
    "ssrf localhost": ([{"type": "image_url", "image_url": {
        "url": "http://127.0.0.1:8000/health"}}], "allowed-media-domains"),
    "file outside": ([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}],
                     "allowed-local-media-path"),
    "too many": ([{"type": "image_url", "image_url": {
        "url": data_url(png_bytes(image(i, 30, 30)))}} for i in range(3)],
                 "limit_mm_per_prompt"),
    "no url": ([{"type": "image_url", "image_url": {}}], "url"),
    "unknown part": ([{"type": "audio_url", "audio_url": {"url": "x"}}], "not supported"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_media_is_a_400(setup, case: str) -> None:
    srv, _, _ = setup
    parts, needle = HOSTILE[case]
    r = _chat(srv, [*parts, {"type": "text", "text": TEXT}])
    assert r.status_code == 400, (case, r.text)
    err = r.json()["error"]
    assert needle.lower() in err["message"].lower(), (case, err)
    assert err["type"] == "BadRequestError"
    ok = _chat(srv, [{"type": "text", "text": TEXT}])
    assert ok.status_code == 200, ok.text


# ---- videos --------------------------------------------------------------------------------

def mp4_bytes(seed: int, frames: int, fps: int, size: int = 56) -> bytes:
    """Noise frames encoded as mp4 with PyAV."""
    import av
    import numpy as np

    rng = np.random.RandomState(seed)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for _ in range(frames):
            rgb = (rng.rand(size, size, 3) * 255).astype(np.uint8)
            out.mux(stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()


def test_video_url_chat_matches_offline(setup) -> None:
    srv, folder, _ = setup
    parts = [{"type": "video_url", "video_url": {"url": data_url(mp4_bytes(1, 16, 4),
                                                                 "video/mp4")}},
             {"type": "text", "text": TEXT}]
    r = _chat(srv, parts)
    assert r.status_code == 200, r.text
    prompt_ids, tokens = r.json()["prompt_token_ids"], r.json()["choices"][0]["token_ids"]

    from shoal import LLM, SamplingParams

    llm = LLM(model=str(folder), dtype="float32", max_model_len=512,
              kv_cache_memory_bytes=16 << 20)
    video_pad = llm.get_tokenizer().convert_tokens_to_ids("<|video_pad|>")
    assert prompt_ids.count(video_pad) == 4 * 2 * 2  # 8 frames at 2 fps of 4x4 patches
    offline = llm.chat([{"role": "user", "content": parts}],
                       SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True),
                       use_tqdm=False)[0]
    assert list(offline.prompt_token_ids) == prompt_ids
    assert list(offline.outputs[0].token_ids) == tokens


def _video_part(url: str) -> dict:
    return {"type": "video_url", "video_url": {"url": url}}


HOSTILE_VIDEOS = {
    "not a video": ([_video_part(data_url(b"\x00" * 2048, "video/mp4"))], "decode"),
    "an image": ([_video_part(data_url(png_bytes(image(4, 32, 32)), "video/mp4"))],
                 "video"),
    "image mime": ([_video_part(data_url(mp4_bytes(2, 4, 2)))], "not a video"),
    "truncated": ([_video_part(data_url(mp4_bytes(3, 12, 4)[:3000], "video/mp4"))],
                  "decode"),
    "too many": ([_video_part(data_url(mp4_bytes(5, 4, 2), "video/mp4"))] * 2,
                 "limit_mm_per_prompt"),
    "file outside": ([_video_part("file:///etc/passwd")], "allowed-local-media-path"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_VIDEOS))
def test_hostile_videos_are_a_400(setup, case: str) -> None:
    srv, _, _ = setup
    parts, needle = HOSTILE_VIDEOS[case]
    r = _chat(srv, [*parts, {"type": "text", "text": TEXT}])
    assert r.status_code == 400, (case, r.text)
    assert needle.lower() in r.json()["error"]["message"].lower(), (case, r.text)
    ok = _chat(srv, [{"type": "text", "text": TEXT}])
    assert ok.status_code == 200, ok.text
