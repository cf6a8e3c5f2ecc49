"""The cache-aware router with images: a chat's block hashes, rebuilt from a backend's
/tokenize (the expanded prompt and each image's span and content hash), are the ones the
engine gives the same chat (its chat route's prompt and features through the engine's
hashing), so two chats that differ only in an image route by the image, and the same pixels
sent in another encoding route alike. In-process: the real /tokenize handler over a tiny
Qwen2.5-VL processor (tokenizer and image processor config only), no model, no server."""

from __future__ import annotations

import asyncio
import base64
import io
import json
from types import SimpleNamespace

import pytest
from vl_checkpoints import QWEN_SPECIALS, image, word_tokenizer

from shoal.engine.input_processor import InputProcessor
from shoal.engine.mm_frontend import MultiModalFrontend
from shoal.engine.request_checks import EngineLimits
from shoal.entrypoints.openai.protocol import ChatCompletionRequest, TokenizeRequest
from shoal.entrypoints.openai.serving_chat import OpenAIServingChat
from shoal.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from shoal.kv_cache.events import BlockStored
from shoal.kv_cache.hashing import hash_full_blocks
from shoal.multimodal.media import MediaSettings
from shoal.router import policy
from shoal.router.policy import Backend, RoutedPrompt, Router, Target, parse_placeholders

BLOCK = 16
TEXT = " ".join(f"w{i}" for i in range(20))  # more than a block before the image


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> SimpleNamespace:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from shoal.multimodal.processors.qwen_vl import QwenVLProcessor

    folder = tmp_path_factory.mktemp("router-vl")
    tok, vocab = word_tokenizer(QWEN_SPECIALS)
    tok.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64).save_pretrained(folder)
    config = SimpleNamespace(image_token_id=tok.convert_tokens_to_ids("<|image_pad|>"),
                             model_type="qwen2_5_vl", video_token_id=None)
    mm = MultiModalFrontend(QwenVLProcessor(folder, config, tok), max_embeds=1024,
                            max_images=2, media=MediaSettings())
    limits = EngineLimits(vocab_size=vocab, max_model_len=512, num_kv_blocks=64,
                          block_size=BLOCK, max_num_seqs=4, mm_max_embeds=1024)
    return SimpleNamespace(tokenizer=tok, inputs=InputProcessor(tok, limits, mm=mm),
                           max_model_len=512)


def png_url(img, level: int = 6) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=level)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(url: str) -> dict:
    parts = [{"type": "text", "text": TEXT}, {"type": "image_url", "image_url": {"url": url}},
             {"type": "text", "text": "w30 w31"}]
    return {"model": "m", "messages": [{"role": "user", "content": parts}]}


def engine_hashes(engine, body: dict) -> list[bytes]:
    """The block hashes the engine gives the chat: the chat route's expanded prompt and
    features, hashed as the KV cache manager hashes a request's blocks."""
    models = SimpleNamespace(check=lambda name: None)
    prompt = OpenAIServingChat(engine, models, None).render(
        ChatCompletionRequest.model_validate(body))
    assert prompt.mm_features
    return hash_full_blocks(prompt.prompt_token_ids, BLOCK, [], None, prompt.mm_features)


def with_tokenize(monkeypatch, engine) -> list[dict]:
    """upstream.request answered by the real /tokenize handler; returns the bodies sent."""
    tokenization = OpenAIServingTokenization(engine, SimpleNamespace(check=lambda n: None))
    sent: list[dict] = []

    async def request(url, method, path, body, headers, timeout=None):
        assert (method, path) == ("POST", "/tokenize")
        sent.append(json.loads(body))
        out = await tokenization.tokenize(TokenizeRequest.model_validate(sent[-1]))
        data = json.dumps(out.body()).encode()

        async def read_all() -> bytes:
            return data

        return SimpleNamespace(status=200, read_all=read_all)

    monkeypatch.setattr(policy.upstream, "request", request)
    return sent


def test_chats_that_differ_in_an_image_route_by_the_image(engine, monkeypatch) -> None:
    sent = with_tokenize(monkeypatch, engine)
    router = Router([Backend("http://a"), Backend("http://b")], block_size=BLOCK)
    x, y = image(1, 112, 112), image(2, 112, 112)
    bodies = {"x": chat(png_url(x)), "y": chat(png_url(y))}
    prompts = {k: asyncio.run(router.prompt("/v1/chat/completions", b, {}))
               for k, b in bodies.items()}
    assert "image_url" in json.dumps(sent[0])  # the parts reach /tokenize
    px, py = prompts["x"], prompts["y"]
    assert px.token_ids == py.token_ids  # same size: the same expanded ids
    assert len(px.images) == 1 and px.images[0].identifier != py.images[0].identifier
    assert px.images[0].length == 16  # 112x112 -> 8x8 patches -> 16 merged tokens
    hx, hy = router.hashes(px, None), router.hashes(py, None)
    assert hx == engine_hashes(engine, bodies["x"]) and hy == engine_hashes(engine, bodies["y"])
    first = px.images[0].offset // BLOCK  # blocks before the image's are the text's alone
    assert first >= 1 and hx[:first] == hy[:first] and hx[first] != hy[first]
    # without the images the two would be one prompt to the router
    assert (router.hashes(RoutedPrompt(px.token_ids), None)
            == router.hashes(RoutedPrompt(py.token_ids), None))

    for backend, hashes in enumerate((hx, hy)):  # a holds x's blocks, b holds y's
        router.index.apply((backend, 0), [BlockStored(hashes, None, [], BLOCK)])
    assert router.choose(hy) == Target(1, 0, len(hy))
    assert router.choose(hx) == Target(0, 0, len(hx))
    # the same pixels in another PNG encoding: the engine's identity is the pixels'
    again = asyncio.run(router.prompt("/v1/chat/completions", chat(png_url(y, level=1)), {}))
    assert router.choose(router.hashes(again, None)) == Target(1, 0, len(hy))


def test_malformed_placeholders_route_by_load() -> None:
    good = [{"modality": "image", "identifier": "ab", "offset": 3, "length": 4}]
    assert parse_placeholders(good)[0].identifier == "ab"
    assert parse_placeholders(None) == []
    for bad in ("x", [1], [{**good[0], "offset": -1}], [{**good[0], "length": "4"}],
                [{**good[0], "identifier": None}]):
        assert parse_placeholders(bad) is None
