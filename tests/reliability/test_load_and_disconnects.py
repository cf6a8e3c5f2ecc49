"""Load, overload and disconnects against the real frontend over the model-free null engine
(issue 18, items 2 and 3): hundreds of streams with a fraction hanging up at random moments,
all others complete and nothing stays running; a burst over the waiting limit gets 503 with
Retry-After while the accepted requests complete."""

from __future__ import annotations

import asyncio

from null_server import (
    OVERLOAD_MAX_SEQS,
    OVERLOAD_MAX_WAITING,
    OVERLOAD_SERVER,
    NullServer,
    burst,
)
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


def test_a_burst_over_the_waiting_limit_gets_503s_and_the_rest_complete():
    # A server of its own, slow enough (20 tokens take a second) that no request can finish
    # while the burst is still arriving: the limit is then met whatever the client's speed.
    srv = NullServer(**OVERLOAD_SERVER)
    try:
        by_status = burst(srv.base_url, 2 * (OVERLOAD_MAX_SEQS + OVERLOAD_MAX_WAITING))
        assert set(by_status) == {200, 503}
        assert len(by_status[200]) >= OVERLOAD_MAX_SEQS + OVERLOAD_MAX_WAITING
        for r in by_status[503]:
            assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == 503
        for r in by_status[200]:
            assert r.json()["usage"]["completion_tokens"] == 20
        assert set(wait_idle(srv.base_url).values()) == {0.0}
    finally:
        srv.stop()
