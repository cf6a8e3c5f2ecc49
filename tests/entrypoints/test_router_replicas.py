"""The cache-aware router over data-parallel replicas: a backend with one KV events endpoint
per DP rank is one engine per rank in the router's index and loads; a request for a block a
replica holds goes to that backend with the replica named in X-data-parallel-rank, and the
server's DP client runs it there (a bad header is a 400 naming it and the range).

End to end on model-free replicas (NullEngineCore: no KV events of their own), the router's
subscribers follow two stand-in publishers, one per rank, as a DP server's replicas bind
them (engine/kv_events.py: the port plus the rank; each batch carries its rank)."""

from __future__ import annotations

import asyncio
import functools
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from shoal.engine.dp_client import DataParallelCoreClient, replica_args
from shoal.engine.engine_args import EngineArgs
from shoal.engine.kv_events import ZmqEventPublisher
from shoal.engine.kv_events_args import KVEventsConfig
from shoal.kv_cache.events import BlockStored, new_batch
from shoal.kv_cache.hashing import hash_full_blocks
from shoal.router.policy import Backend, Router, Target

from .conftest import free_port, free_port_run

BS = 16
PROMPT = list(range(1000, 1000 + 4 * BS))  # four full blocks


# ---- the DP client ------------------------------------------------------------------------
class FakeReplica:
    """What DataParallelCoreClient reads of one replica's client."""

    def __init__(self) -> None:
        self.dead = False
        self.added: list[str] = []

    def add_request(self, req: Any) -> None:
        self.added.append(req.request_id)

    async def get_outputs(self) -> Any:
        await asyncio.Event().wait()  # never: no outputs in this test


def _request(rid: str, rank: int | None = None) -> Any:
    from shoal.core.types import EngineCoreRequest
    from shoal.sampling_params import SamplingParams

    return EngineCoreRequest(rid, [1, 2], SamplingParams(), 0.0, data_parallel_rank=rank)


def test_dp_client_runs_a_request_on_the_replica_it_names() -> None:
    async def run() -> list[list[str]]:
        replicas = [FakeReplica(), FakeReplica()]
        client = DataParallelCoreClient(replicas)  # type: ignore[arg-type]
        try:
            for i in range(3):  # named: all on replica 1 though it is the busier
                client.add_request(_request(f"r1-{i}", 1))
            client.add_request(_request("free"))  # unnamed: the least loaded (0)
            for bad in (2, -1, True):
                with pytest.raises(ValueError, match=r"^data_parallel_rank must be an "
                                   r"integer in \[0, 2\)"):
                    client.add_request(_request("bad", bad))
            replicas[1].dead = True  # a named replica that died: balanced instead
            client.add_request(_request("orphan", 1))
            return [r.added for r in replicas]
        finally:
            for t in client._tasks:
                t.cancel()

    assert asyncio.run(run()) == [["free", "orphan"], ["r1-0", "r1-1", "r1-2"]]


def test_each_replica_gets_its_rank() -> None:
    """Plain DP too (not only DP+EP): each replica's KV events bind their own port and say
    which rank they come from."""
    args = EngineArgs(device="cpu", data_parallel_size=2, cpu_threads=1)
    assert [replica_args(args, r).data_parallel_rank for r in (0, 1)] == [0, 1]
    assert replica_args(args, 1).data_parallel_master_port is None  # DP+EP only


# ---- the router's choice ------------------------------------------------------------------
def test_router_keys_blocks_and_load_by_replica() -> None:
    dp = Backend("http://dp", ["tcp://h:5557", "tcp://h:5558"])
    one = Backend("http://one", ["tcp://h:6000"])
    router = Router([dp, one], block_size=BS, max_imbalance=1)
    assert [r.rank for r in dp.replicas] == [0, 1] and [r.rank for r in one.replicas] == [None]
    h = hash_full_blocks(PROMPT, BS, [])
    router.index.apply((0, 1), [BlockStored(h[:3], None, [], BS)])
    router.index.apply((1, 0), [BlockStored(h[:1], None, [], BS)])
    assert router.choose(h) == Target(0, 1, hit=3)  # the DP backend's rank 1
    dp.replicas[1].in_flight = 2  # too busy: the other replicas are idle
    assert router.choose(h).holder != (0, 1)
    dp.replicas[1].in_flight = 0
    picks = {router.choose([]).holder for _ in range(3)}  # balanced per replica
    assert picks == {(0, 0), (0, 1), (1, 0)}
    state = router.state()["backends"]
    assert state[0]["cached_blocks"] == 3 and state[0]["replicas"][1]["cached_blocks"] == 3
    assert [r["rank"] for r in state[0]["replicas"]] == [0, 1]


def test_the_events_rank_names_the_replica() -> None:
    from shoal.router.app import _learn_rank

    dp = Backend("http://dp", ["tcp://h:5558", "tcp://h:5557"])  # listed out of rank order
    router = Router([dp])
    _learn_rank(router, (0, 0), "tcp://h:5558", new_batch([], 1))
    _learn_rank(router, (0, 1), "tcp://h:5557", new_batch([], 0))
    assert [r.rank for r in dp.replicas] == [1, 0]


# ---- end to end: router -> a DP server of two model-free replicas -------------------------
@asynccontextmanager
async def _serving(app: Any, port: int, lifespan: str) -> AsyncIterator[None]:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan=lifespan))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the server did not start"
        await asyncio.sleep(0.01)
    try:
        yield
    finally:
        server.should_exit = True
        await task


def _served(metrics: str) -> dict[str, float]:
    """Finished requests per engine replica, from the backend's /metrics."""
    out: dict[str, float] = {}
    for line in metrics.splitlines():
        m = re.match(r'shoal:request_success_total\{.*engine="(\d+)".*\} (\S+)', line)
        if m:
            out[m[1]] = out.get(m[1], 0.0) + float(m[2])
    return out


def test_router_sends_a_prefix_to_the_dp_replica_holding_it() -> None:
    from shoal.benchmarks.null_engine import build_null_core
    from shoal.engine.async_llm import AsyncLLM
    from shoal.entrypoints.openai.api_server import build_app as server_app
    from shoal.entrypoints.openai.server_settings import ServerSettings
    from shoal.router.app import build_app as router_app

    async def run() -> None:
        args = EngineArgs(device="cpu", data_parallel_size=2, max_num_seqs=4,
                          max_model_len=256, cpu_threads=1, skip_tokenizer_init=True)
        build = functools.partial(build_null_core, step_time_s=0.002, vocab_size=49152)
        engine = await AsyncLLM.from_engine_args(args, build_core=build, startup_timeout=60,
                                                 log_stats_interval=3600)
        base = free_port_run(2)
        pubs = [ZmqEventPublisher(KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{base}"),
                                  dp_rank=r) for r in (0, 1)]  # binds base + rank
        port, rport = free_port(), free_port()
        backend = Backend(f"http://127.0.0.1:{port}",
                          [f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"],
                          [None, None])
        router = Router([backend], block_size=BS, max_imbalance=4)
        try:
            async with (_serving(server_app(engine, ServerSettings()), port, "off"),
                        _serving(router_app(router), rport, "on"),
                        httpx.AsyncClient(timeout=30) as http):
                # rank 1 cached the prompt's blocks (published until the router hears it:
                # a SUB socket joins some time after it connects)
                stored = BlockStored(hash_full_blocks(PROMPT, BS, []), None, [], BS)
                for _ in range(200):
                    if router.state()["backends"][0]["replicas"][1]["cached_blocks"]:
                        break
                    pubs[1].publish([stored])
                    await asyncio.sleep(0.02)
                assert router.index.num_blocks((0, 1)) == 4
                assert router.index.num_blocks((0, 0)) == 0
                body = {"prompt": PROMPT + [7, 8], "max_tokens": 2}
                for _ in range(3):
                    r = await http.post(f"http://127.0.0.1:{rport}/v1/completions",
                                        json=body)
                    assert r.status_code == 200, r.text
                    assert r.headers["x-shoal-replica"] == "1"
                served = _served((await http.get(f"{backend.url}/metrics")).text)
                assert served.get("1") == 3 and not served.get("0"), served
                routed = router.state()["backends"][0]["replicas"]
                assert [x["prefix_routed"] for x in routed] == [0, 3]
                # a prompt no replica holds: balanced over both replicas
                for i in range(2):
                    r = await http.post(f"http://127.0.0.1:{rport}/v1/completions",
                                        json={"prompt": [5 + i] * 40, "max_tokens": 1})
                    assert r.status_code == 200, r.text
                assert [x["routed"] for x in router.state()["backends"][0]["replicas"]] \
                    == [1, 4]
                # the server itself: the header names a replica, bad values are 400s
                url = f"{backend.url}/v1/completions"
                ok = await http.post(url, json=body, headers={"X-data-parallel-rank": "0"})
                assert ok.status_code == 200
                served = _served((await http.get(f"{backend.url}/metrics")).text)
                assert served.get("0", 0) >= 1
                for bad in ("2", "-1", "one"):
                    r = await http.post(url, json=body, headers={"X-data-parallel-rank": bad})
                    err = r.json()["error"]
                    assert r.status_code == 400 and err["param"] == "X-data-parallel-rank"
                    assert "must be an integer in [0, 2)" in err["message"], err
        finally:
            for p in pubs:
                p.shutdown()
            await engine.shutdown()

    asyncio.run(run())
