"""A request past request_timeout answers 504 with an OpenAI error body, through the real
frontend and engine-core process (the model-free null engine, 20 ms a token); a stream, whose
200 is sent already, ends with the same error as an in-band event, then [DONE]. A request
that finishes in time is answered as usual."""

from __future__ import annotations

import json

import httpx
import pytest
from null_server import NullServer
from server_checks import wait_idle

TIMEOUT_S = 0.3
SLOW = {"max_tokens": 60, "ignore_eos": True}  # 1.2 s at 20 ms a token


@pytest.fixture(scope="module")
def server():
    srv = NullServer(step_ms=20, max_num_seqs=8, max_waiting=16, max_model_len=128,
                     request_timeout=TIMEOUT_S)
    yield srv
    srv.stop()


def _assert_timeout_error(error: dict) -> None:
    assert (error["code"], error["type"]) == (504, "GatewayTimeoutError")
    assert f"request_timeout ({TIMEOUT_S:g} s)" in error["message"]


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
], ids=["completions", "chat"])
def test_a_request_past_request_timeout_answers_504(server, path, body):
    r = httpx.post(server.base_url + path, json={**body, **SLOW}, timeout=30)
    assert r.status_code == 504, r.text
    _assert_timeout_error(r.json()["error"])
    quick = httpx.post(server.base_url + path, json={**body, "max_tokens": 3}, timeout=30)
    assert quick.status_code == 200 and quick.json()["usage"]["completion_tokens"] == 3


def test_a_stream_past_request_timeout_ends_with_an_error_event(server):
    body = {"prompt": "hi", "stream": True, **SLOW}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body,
                      timeout=30) as r:
        assert r.status_code == 200
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    _assert_timeout_error(json.loads(data[-2])["error"])
    chunks = [json.loads(d) for d in data[:-2]]
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"][0]["finish_reason"] is None]
    assert 0 < len(texts) < SLOW["max_tokens"]  # tokens came, then the deadline
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"  # the choice is closed
    assert set(wait_idle(server.base_url).values()) == {0.0}
