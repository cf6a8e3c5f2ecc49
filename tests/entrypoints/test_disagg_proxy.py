"""Prefill/decode disaggregation through real servers: `shoal proxy` in front of a prefill
engine (kv_producer, blocks of 16) and a decode engine (kv_consumer, blocks of 8), a tiny
random Llama with SmolLM2's tokenizer on the CPU. Completions and streamed chats give the
decode engine's own greedy tokens, with the prompt loaded rather than computed there; the KV
of a dead prefill engine is recomputed, and so is every request once the prefill engine is
gone; a bad request is refused as the prefill engine refuses it; many requests at once all
load their KV."""

from __future__ import annotations

import functools
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from oracle import write_tiny_checkpoint

from .conftest import ProxyProcess, RemoteServer, free_port, start_together

pytestmark = pytest.mark.slow

BASE = ["--kv-cache-memory-bytes", str(32 << 20), "--max-model-len", "512", "--dtype",
        "float32"]
PROMPT = ("The quick brown fox jumps over the lazy dog while the cat watches from the "
          "window and the bird sings a long song about the summer that never ends")


class ProxyProc(ProxyProcess):
    def __init__(self, prefill: str, decode: str):
        super().__init__("proxy", "--prefill", prefill, "--decode", decode)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, timeout=120)

    def state(self) -> dict:
        return httpx.get(self.url + "/proxy/state", timeout=10).json()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm_gguf):
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("disagg") / "m", "llama", seed=0,
                                  vocab_size=49152)
    folder, name = smollm_gguf
    tok = ["--tokenizer", f"{folder}/{name}"]
    prefill, decode = start_together(
        functools.partial(RemoteServer, str(model), *tok, "--block-size", "16",
                          "--kv-transfer-config",
                          json.dumps({"kv_connector": "P2PConnector",
                                      "kv_role": "kv_producer", "kv_port": free_port()}),
                          base_args=BASE),
        functools.partial(RemoteServer, str(model), *tok, "--block-size", "8",
                          "--kv-transfer-config",
                          json.dumps({"kv_connector": "P2PConnector",
                                      "kv_role": "kv_consumer"}),
                          "--enable-prompt-tokens-details", base_args=BASE))
    proxy = ProxyProc(prefill.base_url, decode.base_url)
    yield proxy, prefill, decode
    proxy.stop()
    prefill.stop()
    decode.stop()


def _completion(seed: int) -> dict:
    return {"model": "m", "prompt": f"{seed} {PROMPT}", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}


def _tokens(resp: httpx.Response) -> list[int]:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["token_ids"]


def _model(srv: RemoteServer) -> str:
    return srv.get("/v1/models").json()["data"][0]["id"]


def test_proxied_completion_equals_the_decode_engine_alone(cluster) -> None:
    proxy, prefill, decode = cluster
    body = {**_completion(1), "model": _model(decode)}
    want = _tokens(decode.post("/v1/completions", json=body))
    before = proxy.state()["prefilled"]
    resp = proxy.post("/v1/completions", body)
    assert _tokens(resp) == want
    usage = resp.json()["usage"]
    # the decode engine loaded every prompt token but the last
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert proxy.state()["prefilled"] == before + 1


def test_proxied_stream_equals_the_decode_engine_alone(cluster) -> None:
    proxy, prefill, decode = cluster
    body = {"model": _model(decode), "messages": [{"role": "user", "content": PROMPT}],
            "max_tokens": 8, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    want = decode.post("/v1/chat/completions", json=body).json()["choices"][0]["token_ids"]
    resp = proxy.post("/v1/chat/completions", {**body, "stream": True})
    assert resp.status_code == 200, resp.text
    got: list[int] = []
    for line in resp.text.splitlines():
        if line.startswith("data: {"):
            for c in json.loads(line[6:]).get("choices", []):
                got.extend(c.get("token_ids") or [])
    assert got == want


def test_a_bad_request_is_refused_as_the_prefill_engine_refuses_it(cluster) -> None:
    proxy, _, decode = cluster
    resp = proxy.post("/v1/completions", {**_completion(2), "model": _model(decode),
                                          "temperature": -1})
    assert resp.status_code == 400 and "temperature" in resp.text


def test_many_requests_at_once_all_load_their_kv(cluster) -> None:
    """64 completions through the proxy at once (the c64 of the GPU benchmark): each one's prompt is prefilled on the
    prefill engine and loaded by the decode engine (none recomputed), and each gives the
    decode engine's own tokens."""
    proxy, _, decode = cluster
    n = 64
    bodies = [{**_completion(100 + i), "model": _model(decode),
               "prompt": f"Request {i} of many: " + " ".join([PROMPT] * (1 + i % 3))}
              for i in range(n)]
    want = [_tokens(decode.post("/v1/completions", json={**b, "cache_salt": "reference"}))
            for b in bodies]
    before = proxy.state()
    with ThreadPoolExecutor(n) as pool:
        resps = list(pool.map(lambda b: proxy.post("/v1/completions", b), bodies))
    assert [_tokens(r) for r in resps] == want
    for r in resps:
        usage = r.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    after = proxy.state()
    assert after["prefilled"] - before["prefilled"] == n
    assert after["recomputed"] == before["recomputed"]


def test_without_the_prefill_engine_the_decode_engine_recomputes(cluster) -> None:
    proxy, prefill, decode = cluster
    body = {**_completion(3), "model": _model(decode)}
    # (salted: the decode engine's own prefix cache must not hold this prompt afterwards)
    want = _tokens(decode.post("/v1/completions", json={**body, "cache_salt": "reference"}))
    # KV kept by a prefill engine that dies before the decode engine fetches it
    pre = prefill.post("/v1/completions", json={**body, "max_tokens": 1,
                                                 "kv_transfer_params": {
                                                     "do_remote_decode": True}})
    params = pre.json()["kv_transfer_params"]
    prefill.stop()
    late = decode.post("/v1/completions", json={**body, "kv_transfer_params": params})
    assert _tokens(late) == want
    assert late.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # and through the proxy, with no prefill engine at all
    before = proxy.state()["recomputed"]
    assert _tokens(proxy.post("/v1/completions", body)) == want
    assert proxy.state()["recomputed"] == before + 1
