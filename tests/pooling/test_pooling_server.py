"""The pooling endpoints through a real `shoal serve`: /v1/embeddings with the official
openai client (string, list, base64) against offline vectors and transformers, /pooling,
/classify, /score, /rerank on a tiny random cross-encoder, and the 400s (wrong runner,
empty or over-long input, unsupported fields, dimensions on a non-Matryoshka model)."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from entrypoints.conftest import RemoteServer

from shoal import LLM

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog.", "a"]
QUIET = ["--disable-uvicorn-access-log"]


@pytest.fixture(scope="module")
def minilm_server():
    server = RemoteServer("all-MiniLM-L6-v2", base_args=QUIET)  # no other flags
    yield server
    server.stop()


@pytest.fixture(scope="module")
def offline_vectors():
    llm = LLM("all-MiniLM-L6-v2")
    vecs = np.array([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    llm.llm_engine.shutdown()
    return vecs


def test_openai_client_embeddings_match_offline(minilm_server, offline_vectors, minilm_dir):
    client = minilm_server.openai()
    one = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS[0],
                                   encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, offline_vectors[0], atol=1e-5)
    many = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS,
                                    encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    np.testing.assert_allclose([d.embedding for d in many.data], offline_vectors, atol=1e-5)
    # asked for explicitly, the client hands back the base64 strings as they came
    b64 = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS,
                                   encoding_format="base64")
    np.testing.assert_allclose([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4")
                                for d in b64.data], offline_vectors, atol=1e-5)
    # with no format, the client asks for base64 itself and decodes it
    default = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)
    np.testing.assert_allclose([d.embedding for d in default.data], offline_vectors, atol=1e-5)
    assert many.usage.prompt_tokens == many.usage.total_tokens > 3
    # and the transformers oracle (mean pooling + normalize)
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    hf = AutoModel.from_pretrained(str(minilm_dir)).eval()
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = hf(**enc).last_hidden_state
    m = enc["attention_mask"][..., None].float()
    ref = F.normalize((h * m).sum(1) / m.sum(1), dim=-1)
    got = torch.tensor([d.embedding for d in many.data])
    assert float(F.cosine_similarity(got, ref).min()) >= 0.9999


def test_embeddings_token_ids_base64_and_usage(minilm_server, offline_vectors, minilm_dir):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(minilm_dir))(TEXTS)["input_ids"]
    r = minilm_server.post("/v1/embeddings", json={"input": ids, "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    body = r.json()
    vecs = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in body["data"]]
    np.testing.assert_allclose(vecs, offline_vectors, atol=1e-5)
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
    one = minilm_server.post("/v1/embeddings", json={"input": ids[1]}).json()
    np.testing.assert_allclose(one["data"][0]["embedding"], offline_vectors[1], atol=1e-5)
    pooled = minilm_server.post("/pooling", json={"input": TEXTS[0], "task": "token_embed"})
    assert np.array(pooled.json()["data"][0]["data"]).shape == (len(ids[0]), 384)
    score = minilm_server.post("/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(
        [float(offline_vectors[0] @ v) for v in offline_vectors[1:]], abs=1e-5)


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/embeddings", {"input": ""}, "empty"),
    ("/v1/embeddings", {"input": []}, "empty"),
    ("/v1/embeddings", {"input": "word " * 400}, "max_model_len"),
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, "matryoshka"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "messages": [{"role": "user", "content": "x"}]},
     "messages"),
    ("/v1/embeddings", {"input": [1, "a"]}, "input"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "does not generate"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
     "does not generate"),
    ("/classify", {"input": "x"}, "classify"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
])
def test_bad_requests_are_400_with_an_openai_body(minilm_server, path, body, needle):
    r = minilm_server.post(path, json={"model": "all-MiniLM-L6-v2", **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] + str(err.get("param")) and err["code"] == 400


def test_cross_encoder_classify_score_rerank(tiny_cross_encoder):
    path, hf = tiny_cross_encoder
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    query, docs = "what is a fox", ["Paris is in France.", "The quick brown fox.", "fox"]
    enc = tok([query] * 3, docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        ref = hf(**enc).logits[:, 0].sigmoid().tolist()
    server = RemoteServer(str(path), base_args=QUIET)
    try:
        score = server.post("/score", json={"text_1": query, "text_2": docs})
        assert score.status_code == 200, score.text
        assert [d["score"] for d in score.json()["data"]] == pytest.approx(ref, abs=1e-5)
        for route in ("/rerank", "/v1/rerank"):
            r = server.post(route, json={"query": query, "documents": docs, "top_n": 2}).json()
            order = sorted(range(3), key=lambda i: -ref[i])[:2]
            assert [x["index"] for x in r["results"]] == order
            assert r["results"][0]["document"]["text"] == docs[order[0]]
            assert r["results"][0]["relevance_score"] == pytest.approx(ref[order[0]], abs=1e-5)
            assert r["usage"]["total_tokens"] > 0
        cls = server.post("/classify", json={"input": [query]}).json()
        assert cls["data"][0]["num_classes"] == 1
        with torch.no_grad():
            alone = float(hf(**tok(query, return_tensors="pt")).logits[0, 0].sigmoid())
        assert cls["data"][0]["probs"][0] == pytest.approx(alone, abs=1e-5)
        bad = server.post("/v1/embeddings", json={"input": "x"})
        assert bad.status_code == 400 and "embed" in bad.json()["error"]["message"]
    finally:
        server.stop()


def test_pooling_endpoints_on_a_generation_model_are_400(tiny_llama_dir):
    # 64 blocks: the CPU default (4 GiB) is ~500k block objects, ~1.3 s of the server's start
    server = RemoteServer(str(tiny_llama_dir), base_args=QUIET + [
        "--max-model-len", "128", "--num-gpu-blocks-override", "64"])
    try:
        for path, body in [("/v1/embeddings", {"input": [1, 2, 3]}),
                           ("/classify", {"input": [1, 2]}),
                           ("/score", {"text_1": "a", "text_2": "b"}),
                           ("/rerank", {"query": "a", "documents": ["b"]})]:
            r = server.post(path, json=body)
            assert r.status_code == 400, r.text
            assert "pooling model" in r.json()["error"]["message"]
    finally:
        server.stop()


def test_bge_m3_outputs_over_pooling(tmp_path, minilm_dir):
    """--hf-overrides selects BGE-M3; /pooling answers its dense, ColBERT and sparse outputs
    as the offline engine does."""
    import json

    from pooling_models import make_tiny

    make_tiny(tmp_path, minilm_dir, "xlmr")
    torch.manual_seed(3)
    torch.save(torch.nn.Linear(32, 32).state_dict(), tmp_path / "colbert_linear.pt")
    torch.save(torch.nn.Linear(32, 1).state_dict(), tmp_path / "sparse_linear.pt")
    overrides = {"architectures": ["BgeM3EmbeddingModel"]}
    llm = LLM(str(tmp_path), hf_overrides=overrides)
    offline = {task: llm.encode(TEXTS[1], pooling_task=task, use_tqdm=False)[0].outputs.data
               for task in ("embed", "token_embed", "token_classify")}
    llm.llm_engine.shutdown()
    server = RemoteServer(str(tmp_path), base_args=QUIET + ["--hf-overrides",
                                                            json.dumps(overrides)])
    try:
        for task, ref in offline.items():
            r = server.post("/pooling", json={"input": TEXTS[1], "task": task})
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["data"][0]["data"], ref.numpy(), atol=1e-5)
    finally:
        server.stop()


def test_truncation_keeps_the_special_tokens_as_offline(minilm_server, minilm_dir):
    """truncate_prompt_tokens on /v1/embeddings: the text's end goes, [CLS] and [SEP] stay
    (the tokenizer's truncation), the same tokens as PoolingParams.truncate_prompt_tokens."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(minilm_dir))
    text = TEXTS[1]
    want = tok.encode(text, truncation=True, max_length=6)
    assert want[0] == tok.cls_token_id and want[-1] == tok.sep_token_id
    cut = minilm_server.post("/v1/embeddings", json={"input": text,
                                                    "truncate_prompt_tokens": 6}).json()
    ids = minilm_server.post("/v1/embeddings", json={"input": want}).json()
    assert cut["usage"]["prompt_tokens"] == 6
    assert cut["data"][0]["embedding"] == ids["data"][0]["embedding"]
