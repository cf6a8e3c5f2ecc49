"""`shoal router --backend URL [--kv-events tcp://host:5557] ...`: flags and start-up."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the parser is built for every `shoal` command: no imports it needs not
    from shoal.router.policy import Router


def add_router_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", action="append", required=True, metavar="URL",
                   help="a backend server, http://host:port (repeat for each)")
    p.add_argument("--kv-events", action="append", default=[], metavar="ENDPOINT",
                   help="the KV events PUB endpoint of each backend, in --backend order "
                        "(tcp://host:5557; for a data-parallel backend each replica's, "
                        "comma-separated in rank order: tcp://host:5557,tcp://host:5558, so "
                        "requests go to the replica holding their prefix and the load is "
                        "balanced per replica). Without them requests are balanced by load "
                        "alone")
    p.add_argument("--kv-events-replay", action="append", default=[], metavar="ENDPOINT",
                   help="the replay endpoint of each backend, in the same order "
                        "(comma-separated like --kv-events; optional)")
    p.add_argument("--kv-events-topic", default="", help="the topic the backends publish on")
    p.add_argument("--block-size", type=int, default=16,
                   help="the backends' KV block size (learned from their events too)")
    p.add_argument("--max-imbalance", type=int, default=8,
                   help="a prefix hit is taken unless its backend has more than this many "
                        "requests in flight beyond the least loaded one")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)


def _split(values: list[str], n: int, flag: str) -> list[list[str]]:
    if values and len(values) != n:
        raise ValueError(f"{flag}: give one per --backend ({n}), got {len(values)}")
    return [[e for e in v.split(",") if e] for v in values] or [[] for _ in range(n)]


def router_from(ns: argparse.Namespace) -> Router:
    from shoal.router.policy import Backend, Router

    n = len(ns.backend)
    events = _split(ns.kv_events, n, "--kv-events")
    replays = _split(ns.kv_events_replay, n, "--kv-events-replay")
    backends = []
    for url, pubs, reps in zip(ns.backend, events, replays):
        if reps and len(reps) != len(pubs):
            raise ValueError(f"--kv-events-replay of {url}: one per --kv-events endpoint")
        backends.append(Backend(url.rstrip("/"), pubs, list(reps) or [None] * len(pubs)))
    if ns.block_size < 1 or ns.max_imbalance < 0:
        raise ValueError("--block-size must be >= 1 and --max-imbalance >= 0")
    return Router(backends, ns.block_size, ns.max_imbalance)


def run_router(ns: argparse.Namespace) -> int:
    import uvicorn

    from shoal.router.app import build_app

    app = build_app(router_from(ns), ns.kv_events_topic)
    uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.log_level.lower(),
                access_log=False)
    return 0
