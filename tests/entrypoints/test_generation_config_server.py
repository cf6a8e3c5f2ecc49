"""`shoal serve` with a model whose generation_config.json sets sampling fields: requests that
leave a field unset take the file's value, explicit fields win, and max_new_tokens caps
max_tokens (vLLM's --generation-config auto). A tiny random Llama with SmolLM2's tokenizer."""

from __future__ import annotations

import json

import pytest
from oracle import write_tiny_checkpoint

from .conftest import RemoteServer

pytestmark = pytest.mark.slow

CAP = 6


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from shoal.loader import load_frontend_tokenizer

    folder = tmp_path_factory.mktemp("gen-config")
    tok = load_frontend_tokenizer(None, None)
    tok.save_pretrained(folder)
    write_tiny_checkpoint(folder, "llama", seed=1, vocab_size=len(tok))
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": tok.eos_token_id, "temperature": 0.0, "max_new_tokens": CAP}))
    srv = RemoteServer(str(folder), "--dtype", "float32",
                       base_args=["--kv-cache-memory-bytes", str(64 << 20),
                                  "--max-model-len", "256"])
    yield srv
    srv.stop()


def _completion(srv, **fields) -> dict:
    r = srv.post("/v1/completions", json={"prompt": "The capital of France is",
                                          "ignore_eos": True, "return_token_ids": True,
                                          **fields})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_unset_fields_take_the_generation_config_s(server) -> None:
    # temperature 0 from the file: repeatable, and the greedy tokens; 16 (the completions
    # default) capped at max_new_tokens
    a, b = _completion(server), _completion(server)
    greedy = _completion(server, temperature=0, max_tokens=CAP)
    assert a["token_ids"] == b["token_ids"] == greedy["token_ids"]
    assert len(a["token_ids"]) == CAP and a["finish_reason"] == "length"


def test_explicit_fields_win_and_max_new_tokens_caps_max_tokens(server) -> None:
    capped = _completion(server, max_tokens=CAP + 10)
    assert len(capped["token_ids"]) == CAP  # vLLM's min(request, generation config)
    greedy = _completion(server, max_tokens=CAP)["token_ids"]
    sampled = [_completion(server, temperature=1.5, seed=s)["token_ids"] for s in range(4)]
    assert any(ids != greedy for ids in sampled)


def test_chat_and_responses_take_the_defaults_too(server) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    r = server.post("/v1/chat/completions", json={"messages": msgs, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == CAP
    r = server.post("/v1/responses", json={"input": "Hi"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["temperature"] == 0.0 and body["usage"]["output_tokens"] <= CAP
