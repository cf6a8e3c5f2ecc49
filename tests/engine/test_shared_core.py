"""One engine-core process shared by several clients (engine/shared_core.py), over real ZMQ
sockets with the model-free null core: ids namespaced per client, aborts and deaths."""

from __future__ import annotations

import asyncio
import functools
import multiprocessing
import os
import signal
import time

import pytest

from shoal.benchmarks.null_engine import build_null_core
from shoal.core.types import EngineCoreRequest
from shoal.engine.engine_args import EngineArgs
from shoal.engine.shared_client import SharedCoreClient
from shoal.sampling_params import SamplingParams

BUILD = functools.partial(build_null_core, step_time_s=0.002, vocab_size=1000)


def _req(rid: str, max_tokens: int) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [5, 6, 7], SamplingParams(max_tokens=max_tokens,
                                                             ignore_eos=True),
                             arrival_time=time.monotonic())


async def _tokens(client: SharedCoreClient, rid: str, timeout: float = 10.0) -> tuple[int, str]:
    """Outputs of `rid` on `client` until it finishes: (tokens, finish reason)."""
    n = 0
    async with asyncio.timeout(timeout):
        while True:
            msg = await client.get_outputs()
            for out in msg.outputs.outputs:
                if out.request_id != rid:
                    continue  # (an earlier request of this client's)
                n += len(out.new_token_ids)
                if out.finish_reason is not None:
                    return n, out.finish_reason


async def _running(client: SharedCoreClient, want: int, timeout: float = 10.0) -> None:
    """Waits until the engine's last step ran `want` requests."""
    async with asyncio.timeout(timeout):
        while (await client.call_utility("get_stats")).get("num_running", 0) != want:
            await asyncio.sleep(0.02)


def _attach_and_hang(address: str, engine_pid: int) -> None:
    """A client process that starts a long request, then waits to be killed."""
    async def main() -> None:
        client = SharedCoreClient.attach(address, engine_pid)
        await client.wait_ready(10)
        client.add_request(_req("long", 100_000))
        await asyncio.sleep(60)

    asyncio.run(main())


@pytest.fixture
def shared_engine():
    async def start() -> SharedCoreClient:
        owner = await SharedCoreClient.start(EngineArgs(max_model_len=200_000), build_core=BUILD)
        await owner.wait_ready(60)
        return owner
    return start


def test_clients_have_their_own_ids_aborts_and_lives(shared_engine):
    async def main() -> None:
        owner = await shared_engine()
        a = SharedCoreClient.attach(owner.address, owner.proc.pid)
        b = SharedCoreClient.attach(owner.address, owner.proc.pid)
        try:
            await asyncio.gather(a.wait_ready(10), b.wait_ready(10))
            # the same id from two clients: two requests, each answered to its sender
            a.add_request(_req("r", 5))
            b.add_request(_req("r", 9))
            assert await asyncio.gather(_tokens(a, "r"), _tokens(b, "r")) == [
                (5, "length"), (9, "length")]
            # a's abort of "x" stops a's "x" alone
            a.add_request(_req("x", 100_000))
            b.add_request(_req("x", 20))
            await asyncio.sleep(0.1)
            a.abort_requests(["x"])
            assert (await _tokens(b, "x"))[0] == 20
            # utilities answer their caller, from any client
            assert await asyncio.gather(a.call_utility("ping"), b.call_utility("ping")) == [
                "pong", "pong"]
            # a client's Shutdown only detaches it: its requests go, the engine stays
            b.add_request(_req("y", 100_000))
            await _running(owner, 1)
            await b.shutdown()
            await _running(owner, 0)
            assert owner.is_alive and await a.call_utility("ping") == "pong"
            # a client process that dies: its requests are aborted, the engine goes on
            ctx = multiprocessing.get_context("spawn")
            child = ctx.Process(target=_attach_and_hang, args=(owner.address, owner.proc.pid))
            child.start()
            await _running(owner, 1, timeout=60)
            os.kill(child.pid, signal.SIGKILL)
            child.join(10)
            await _running(owner, 0)
            a.add_request(_req("z", 3))
            assert await _tokens(a, "z") == (3, "length")
        finally:
            await a.shutdown()
            await owner.shutdown()
        assert not owner.proc.is_alive() and owner.proc.exitcode == 0

    asyncio.run(main())


def test_a_failed_start_reaches_the_clients_waiting(shared_engine):
    async def main() -> None:
        owner = await SharedCoreClient.start(EngineArgs(), build_core=_fail)
        try:
            with pytest.raises(Exception, match="no model here"):
                await owner.wait_ready(60)
        finally:
            await owner.shutdown()

    asyncio.run(main())


def _fail(_engine_args: EngineArgs) -> None:
    raise RuntimeError("no model here")
