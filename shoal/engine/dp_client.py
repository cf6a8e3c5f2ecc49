"""Data parallelism: several engine core processes, each a whole replica of the model, behind
one frontend (vLLM's `data_parallel_size` with its internal load balancing).

`DataParallelCoreClient` has EngineCoreClient's interface, so AsyncLLM does not know how
many engines it drives. A new request goes to the engine with the fewest requests in flight
(ties: the lowest rank); its aborts follow it there. Outputs of all engines feed one queue;
their statistics are merged so the frontend's metrics describe the whole server: gauges and
cumulative counters are summed over each engine's latest report, per-step token counts come
from the message they arrived with. Replica r runs on GPU r * tensor_parallel_size (on the
CPU, the cores are shared out between the replicas).

DP+EP (enable_expert_parallel): the replicas also split the MoE experts between them and step
in lockstep (shoal/engine/dp_lockstep.py); each gets its rank and the port they meet on here.
Such a server cannot outlive one of its replicas: like any engine death, it fails every
request in flight and /health answers 503."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import Callable
from typing import Any

import msgspec

from shoal.engine.core_client import EngineCoreClient, EngineDeadError
from shoal.engine.core_proc import CoreOutputs, Ready
from shoal.engine.core_types import EngineCoreRequest, SchedulerStats
from shoal.engine.cpu_threads import available_cores
from shoal.engine.engine_args import EngineArgs
from shoal.engine.input_processor import EngineLimits

logger = logging.getLogger(__name__)

# Cumulative since start-up (summed over each replica's latest report) vs. this step's own.
_CUMULATIVE = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")
_GAUGES = ("num_running", "num_waiting", "num_waiting_deferred")


def replica_args(engine_args: EngineArgs, rank: int, port: int | None = None) -> EngineArgs:
    """The engine arguments of replica `rank`: its own GPU(s), or its share of the cores;
    DP+EP: its rank in the replicas' process group, which meets on `port`."""
    dp = engine_args.data_parallel_size
    if engine_args.enable_expert_parallel is True:
        engine_args = dataclasses.replace(engine_args, data_parallel_rank=rank,
                                          data_parallel_master_port=port)
    device = engine_args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        first = int(device.split(":")[1]) if ":" in device else 0
        world = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
        device = f"cuda:{first + rank * world}"
        return dataclasses.replace(engine_args, device=device)
    threads = engine_args.cpu_threads or max(1, (available_cores() - 1) // dp)
    return dataclasses.replace(engine_args, device=device, cpu_threads=threads)


def merge_limits(limits: list[EngineLimits]) -> EngineLimits:
    """What a request is validated against: it must fit any replica's KV pool; the server as
    a whole runs every replica's batch."""
    return msgspec.structs.replace(limits[0], num_kv_blocks=min(x.num_kv_blocks for x in limits),
                                   max_num_seqs=sum(x.max_num_seqs for x in limits))


class DataParallelCoreClient:
    def __init__(self, clients: list[EngineCoreClient]):
        self.clients = clients
        self._in_flight = [0] * len(clients)
        self._owner: dict[str, int] = {}
        self._latest = [SchedulerStats() for _ in clients]
        self._outputs: asyncio.Queue[CoreOutputs | BaseException] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._forward(i), name=f"engine-{i}-outputs")
                       for i in range(len(clients))]

    @classmethod
    async def start(cls, engine_args: EngineArgs, log_level: int = logging.INFO,
                    build_core: Callable[[EngineArgs], Any] | None = None
                    ) -> DataParallelCoreClient:
        clients: list[EngineCoreClient] = []
        port = _free_port()  # DP+EP: where the replicas' process group meets
        try:
            for rank in range(engine_args.data_parallel_size):
                clients.append(await EngineCoreClient.start(
                    replica_args(engine_args, rank, port), log_level=log_level,
                    build_core=build_core))
        except BaseException:
            for c in clients:
                await c.shutdown()
            raise
        return cls(clients)

    async def wait_ready(self, timeout: float | None = None) -> Ready:
        readies = await asyncio.gather(*(c.wait_ready(timeout) for c in self.clients))
        return Ready(merge_limits([r.limits for r in readies]), pid=readies[0].pid)

    # ---- traffic --------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        rank = min(range(len(self.clients)), key=lambda i: (self._in_flight[i], i))
        self.clients[rank].add_request(req)
        self._owner[req.request_id] = rank
        self._in_flight[rank] += 1

    def abort_requests(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self._release(rid)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
        for rank, ids in by_rank.items():
            self.clients[rank].abort_requests(ids)

    async def call_utility(self, method: str, timeout: float = 10.0) -> Any:
        results = await asyncio.gather(*(c.call_utility(method, timeout) for c in self.clients))
        if method == "get_stats":
            return msgspec.to_builtins(_sum_stats(
                [msgspec.convert(r, SchedulerStats) for r in results], SchedulerStats()))
        return results[0]

    async def get_outputs(self) -> CoreOutputs:
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self._outputs.put_nowait(item)
            raise item
        return item

    def on_dead(self, callback: Callable[[], None]) -> None:
        for c in self.clients:
            c.on_dead(callback)

    @property
    def dead(self) -> bool:
        return any(c.dead for c in self.clients)

    @property
    def is_alive(self) -> bool:
        return all(c.is_alive for c in self.clients)

    async def shutdown(self, timeout: float = 5.0) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*(c.shutdown(timeout) for c in self.clients))

    # ---- internals ------------------------------------------------------------------------
    def _release(self, request_id: str) -> int | None:
        rank = self._owner.pop(request_id, None)
        if rank is not None:
            self._in_flight[rank] -= 1
        return rank

    async def _forward(self, rank: int) -> None:
        """Replica `rank`'s outputs into the shared queue, with the server-wide statistics."""
        client = self.clients[rank]
        while True:
            try:
                msg = await client.get_outputs()
            except EngineDeadError as e:
                self._outputs.put_nowait(e)
                return
            for out in msg.outputs.outputs:
                if out.finish_reason is not None:
                    self._release(out.request_id)
            for rid in msg.rejected:
                self._release(rid)
            if msg.outputs.stats is not None:
                self._latest[rank] = msg.outputs.stats
                msg.outputs.stats = _sum_stats(self._latest, msg.outputs.stats)
            self._outputs.put_nowait(msg)


def _sum_stats(latest: list[SchedulerStats], step: SchedulerStats) -> SchedulerStats:
    """Gauges and cumulative counters over every replica's latest report; the step's own
    token and speculation counts; the KV usage averaged over the replicas."""
    fields: dict[str, Any] = {name: sum(getattr(s, name) for s in latest)
                              for name in (*_GAUGES, *_CUMULATIVE)}
    fields["kv_cache_usage"] = sum(s.kv_cache_usage for s in latest) / len(latest)
    return msgspec.structs.replace(step, **fields)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
