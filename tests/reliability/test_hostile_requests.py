"""Hostile requests against a real `shoal serve` (issue 18, item 1): every case of
hostile_cases.py gets a 4xx with an OpenAI error body, none a 5xx; the server stays healthy
and a normal request gets exactly the answer it got before them."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from entrypoints.conftest import RemoteServer
from hostile_cases import Case, hostile_cases
from server_checks import wait_idle
from storm import storm

NORMAL = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    srv = RemoteServer()
    srv.before = srv.post("/v1/completions", json=NORMAL).json()["choices"][0]["text"]
    yield srv
    srv.stop()


def send(base_url: str, case: Case) -> httpx.Response:
    return httpx.request(case.method, base_url + case.path, timeout=120,
                         **case.request_kwargs())


def is_openai_error(resp: httpx.Response) -> bool:
    try:
        err = resp.json()["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err.get("message"), str) and err.get("code") == resp.status_code


CASES = hostile_cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_hostile_request_gets_a_4xx_with_an_openai_error(server, case):
    resp = send(server.base_url, case)
    assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:300])
    if case.status is not None:
        assert resp.status_code == case.status, resp.text[:300]
    assert is_openai_error(resp), resp.text[:300]


def test_streams_hanging_up_leave_no_request_and_no_kv_block(server):
    """The real model: of 16 streams half hang up at random moments; the others complete, and
    afterwards nothing runs or waits and no KV block is in use."""
    results = asyncio.run(storm("127.0.0.1", server.port, clients=16, hang_up_fraction=0.5,
                                max_tokens=12, seed=2))
    kept = [r for r in results if r.hang_up_after is None]
    assert kept and len(kept) < 16 and not any(r.done for r in results if r not in kept)
    for r in kept:
        assert (r.status, r.done, r.error, r.completion_tokens) == (200, True, None, 12)
    assert set(wait_idle(server.base_url).values()) == {0.0}


def test_after_them_the_server_answers_as_before(server):
    assert server.get("/health").status_code == 200
    again = server.post("/v1/completions", json=NORMAL).json()["choices"][0]["text"]
    assert again == server.before
    assert set(wait_idle(server.base_url).values()) == {0.0}
