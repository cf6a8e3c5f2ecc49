"""Cohere's POST /v2/embed (vLLM 0.28's) through a real `shoal serve` of all-MiniLM-L6-v2:
float embeddings and token counts equal /v1/embeddings', the binary/ubinary/base64 types,
the response's shape, END/START/NONE truncation, the API key, and the 400s naming the field.
The input_type prompt prefixes are checked in process (MiniLM defines none)."""

from __future__ import annotations

import base64
import json
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from shoal.entrypoints.openai.cohere_embed import CohereEmbedHandler, CohereEmbedRequest
from shoal.entrypoints.openai.errors import OpenAIError
from shoal.entrypoints.openai.protocol_pooling import EmbeddingRequest
from shoal.loader.resolve import MINILM, locate_embedded
from shoal.loader.tokenizers import load_tokenizer

from .conftest import RemoteServer

pytestmark = pytest.mark.slow

MODEL = "all-MiniLM-L6-v2"
KEY = "sk-cohere"
TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "chocolate cake"]
LONG = " ".join([f"alpha{i}" for i in range(300)] + [f"omega{i}" for i in range(300)])


@pytest.fixture(scope="module")
def server():
    s = RemoteServer(MODEL, api_key=KEY, base_args=["--disable-uvicorn-access-log"])
    yield s
    s.stop()


def embed(server: RemoteServer, **body) -> httpx.Response:
    return server.post("/v2/embed", json={"model": MODEL, **body})


def ok(server: RemoteServer, **body) -> dict:
    r = embed(server, **body)
    assert r.status_code == 200, r.text
    return r.json()


def test_api_key(server):
    body = {"model": MODEL, "texts": ["hello"], "embedding_types": ["float"]}
    assert httpx.post(server.base_url + "/v2/embed", json=body).status_code == 401
    wrong = httpx.post(server.base_url + "/v2/embed", json=body,
                       headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert embed(server, texts=["hello"], embedding_types=["float"]).status_code == 200


def test_float_parity_and_shape(server):
    v2 = ok(server, texts=TEXTS, embedding_types=["float"])
    v1 = server.post("/v1/embeddings", json={"model": MODEL, "input": TEXTS,
                                             "encoding_format": "float"}).json()
    assert v2["embeddings"]["float"] == [d["embedding"] for d in v1["data"]]  # bit for bit
    assert set(v2) == {"id", "embeddings", "texts", "meta", "response_type"}
    assert v2["id"].startswith("embd-")
    assert set(v2["embeddings"]) == {"float"}
    assert v2["texts"] == TEXTS
    assert v2["response_type"] == "embeddings_by_type"
    assert v2["meta"] == {"api_version": {"version": "2"},
                          "billed_units": {"input_tokens": v1["usage"]["prompt_tokens"],
                                           "image_tokens": 0}}
    vecs = np.array(v2["embeddings"]["float"])
    assert vecs.shape == (3, 384)
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-4)
    # no embedding_types: float only
    default = ok(server, texts=TEXTS[:1])
    assert default["embeddings"] == {"float": v2["embeddings"]["float"][:1]}


def test_embedding_types(server):
    r = ok(server, texts=TEXTS, embedding_types=["float", "binary", "ubinary", "base64"])
    assert set(r["embeddings"]) == {"float", "binary", "ubinary", "base64"}
    vecs = np.array(r["embeddings"]["float"], dtype=np.float32)
    bits = np.packbits(vecs >= 0, axis=-1).astype(int)
    assert r["embeddings"]["ubinary"] == bits.tolist()
    assert r["embeddings"]["binary"] == (bits - 128).tolist()
    assert all(len(b) == 384 // 8 for b in r["embeddings"]["binary"])
    decoded = [np.frombuffer(base64.b64decode(s), dtype="<f4") for s in r["embeddings"]["base64"]]
    np.testing.assert_array_equal(decoded, vecs)
    only = ok(server, texts=TEXTS[:1], embedding_types=["ubinary"])
    assert set(only["embeddings"]) == {"ubinary"}


def test_truncation(server):
    end = ok(server, texts=[LONG], truncate="END")
    start = ok(server, texts=[LONG], truncate="START")
    assert ok(server, texts=[LONG])["embeddings"] == end["embeddings"]  # END: the default
    max_len = server.get("/v1/models").json()["data"][0]["max_model_len"]  # 256 for MiniLM
    assert end["meta"]["billed_units"]["input_tokens"] == max_len
    a, b = np.array(end["embeddings"]["float"][0]), np.array(start["embeddings"]["float"][0])
    assert float(a @ b) < 0.99  # START keeps the omegas, END the alphas
    cut = ok(server, texts=[LONG], truncate="END", max_tokens=16)
    assert cut["meta"]["billed_units"]["input_tokens"] == 16
    # END truncates as the tokenizer does: [CLS] ... [SEP] kept (vLLM's); START slices ids
    tok = load_tokenizer(MODEL)
    full = tok.encode(LONG)
    for ids, truncate in ((tok.encode(LONG, truncation=True, max_length=16), "END"),
                          (full[-16:], "START")):
        want = server.post("/v1/embeddings", json={"input": ids}).json()["data"][0]
        got = ok(server, texts=[LONG], truncate=truncate, max_tokens=16)
        assert got["embeddings"]["float"][0] == want["embedding"], truncate
    assert ok(server, texts=[LONG], max_tokens=1)["meta"]["billed_units"]["input_tokens"] == 1
    r = embed(server, texts=[LONG], truncate="NONE")
    assert r.status_code == 400, r.text
    r = embed(server, texts=["hello world, how are you"], truncate="NONE", max_tokens=3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert "truncate=NONE" in r.json()["error"]["message"]
    assert embed(server, texts=["hi"], truncate="NONE", max_tokens=100).status_code == 200


@pytest.mark.parametrize("body, param, words", [
    ({}, "texts", "Exactly one of texts, images, or inputs"),
    ({"texts": []}, "texts", "non-empty"),
    ({"texts": ["a"], "images": ["data:image/png;base64,AAAA"]}, "texts", "Exactly one"),
    ({"images": ["data:image/png;base64,AAAA"]}, "images", "not supported"),
    ({"inputs": [{"content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "inputs", "image_url"),
    ({"inputs": [{"content": [{"type": "text", "text": "hi"}]}]}, "inputs", "send texts"),
    ({"texts": ["a"], "input_type": "search_query"}, "input_type", "Unsupported input_type"),
    ({"texts": ["a"], "embedding_types": ["int8"]}, "embedding_types", ""),
    ({"texts": ["a"], "truncate": "MIDDLE"}, "truncate", ""),
    ({"texts": ["a"], "output_dimension": 128}, "output_dimension", "matryoshka"),
    ({"texts": [""]}, "texts", "empty"),
    ({"texts": ["a"], "max_tokens": 0}, "max_tokens", ">= 1"),
    ({"texts": "a"}, "texts", ""),
])
def test_errors(server, body, param, words):
    r = embed(server, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400, err
    assert words in err["message"]


def stub_handler(folder, chat_template=None) -> CohereEmbedHandler:
    engine = SimpleNamespace(engine_args=SimpleNamespace(model=str(folder)), max_model_len=512,
                             tokenizer=SimpleNamespace(chat_template=chat_template))
    pooling = SimpleNamespace(engine=engine, _prompt=lambda item, req, side: item)
    return CohereEmbedHandler(pooling)  # type: ignore[arg-type]


def test_input_type_prefixes(tmp_path):
    """vLLM's prompt prefixes: config.json's task_instructions, else the sentence-transformers
    prompts; prepended to each text (no chat template)."""
    assert stub_handler(locate_embedded(MINILM)).task_instructions is None
    (tmp_path / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "document": "passage: ", "bad": 3}}))
    h = stub_handler(tmp_path)
    assert h.task_instructions == {"query": "query: ", "document": "passage: "}
    proxy = EmbeddingRequest(input="hi")  # no truncation
    assert h._prompt("hi", "query: ", proxy, "right") == "query: hi"
    assert h._prompt("hi", None, proxy, "right") == "hi"
    h._validate(CohereEmbedRequest(texts=["a"], input_type="query"))
    with pytest.raises(OpenAIError, match="Supported values: document, query"):
        h._validate(CohereEmbedRequest(texts=["a"], input_type="search_query"))
    (tmp_path / "config.json").write_text(json.dumps({"task_instructions": {"q": "Q: "}}))
    assert stub_handler(tmp_path).task_instructions == {"q": "Q: "}
