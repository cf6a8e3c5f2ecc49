"""Load, overload and disconnects against the real frontend over the model-free null engine
(issue 18, items 2 and 3): hundreds of streams with a fraction hanging up at random moments,
all others complete and nothing stays running; a burst over the waiting limit gets 503 with
Retry-After while the accepted requests complete."""

from __future__ import annotations

import asyncio

import httpx
from null_server import NULL_MAX_SEQS as MAX_SEQS
from null_server import NULL_MAX_WAITING as MAX_WAITING
from server_checks import wait_idle
from storm import storm


def test_hundreds_of_streams_with_random_hang_ups(null_server):
    results = asyncio.run(storm("127.0.0.1", null_server.port, clients=300,
                                hang_up_fraction=0.3, max_tokens=32, seed=1))
    kept = [r for r in results if r.hang_up_after is None]
    hung_up = [r for r in results if r.hang_up_after is not None]
    assert len(kept) > 150 and len(hung_up) > 50 and not any(r.done for r in hung_up)
    for r in kept:
        assert (r.status, r.done, r.error, r.completion_tokens, r.finish_reasons) == (
            200, True, None, 32, ["length"])
    assert set(wait_idle(null_server.base_url).values()) == {0.0}


def test_a_burst_over_the_waiting_limit_gets_503s_and_the_rest_complete(null_server):
    async def burst() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(base_url=null_server.base_url, timeout=120,
                                     limits=limits) as client:
            body = {"prompt": "hi", "max_tokens": 20, "ignore_eos": True}
            return await asyncio.gather(*(client.post("/v1/completions", json=body)
                                          for _ in range(2 * (MAX_SEQS + MAX_WAITING))))
    by_status: dict[int, list[httpx.Response]] = {}
    for r in asyncio.run(burst()):
        by_status.setdefault(r.status_code, []).append(r)
    assert set(by_status) == {200, 503}
    assert len(by_status[200]) >= MAX_SEQS + MAX_WAITING
    for r in by_status[503]:
        assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == 503
    for r in by_status[200]:
        assert r.json()["usage"]["completion_tokens"] == 20
    assert set(wait_idle(null_server.base_url).values()) == {0.0}
