"""Data parallelism: several engine core processes, each a whole replica of the model, behind
one frontend (vLLM's `data_parallel_size` with its internal load balancing).

`DataParallelCoreClient` has EngineCoreClient's interface, so AsyncLLM does not know how
many engines it drives. A new request goes to the engine with the fewest requests in flight
(ties: the lowest rank), unless it names its replica (`data_parallel_rank`, which the HTTP
server takes from vLLM's `X-data-parallel-rank` header: a cache-aware router sends it to the
replica holding its prefix); its aborts follow it there. Outputs of all engines feed one queue,
each message tagged with its replica (`engine_index`): the metrics are labelled per engine, as
vLLM's, and the frontend merges the replicas' latest statistics for the log line and its
queue limit. Replica r runs on GPU r * tensor_parallel_size (on the CPU, the cores are shared
out between the replicas).

A replica that dies takes only its own requests with it: they end with an error, new
requests go to the replicas still running, and the server (its /health included) is dead only
when the last replica is.

DP+EP (enable_expert_parallel): the replicas also split the MoE experts between them and step
in lockstep (shoal/engine/dp_lockstep.py); each gets its rank and the port they meet on here.
Such a server cannot outlive one of its replicas (the survivors' collectives fail): like any
engine death, it fails every request in flight and /health answers 503."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from collections.abc import Callable
from typing import Any

import msgspec

from shoal.core.types import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from shoal.engine.core_client import EngineCoreClient
from shoal.engine.core_messages import CoreOutputs, Ready
from shoal.engine.cpu_quota import usable_cores
from shoal.engine.engine_args import EngineArgs
from shoal.engine.request_checks import EngineLimits
from shoal.engine.request_errors import EngineDeadError
from shoal.metrics.stats import CUMULATIVE_FIELDS, merge_engine_stats

logger = logging.getLogger(__name__)


def check_data_parallel_rank(rank: object, size: int, field: str = "data_parallel_rank"
                             ) -> int | None:
    """A request's replica (None: any); ValueError naming `field` unless an integer in
    [0, size)."""
    if rank is None:
        return None
    if type(rank) is not int or not 0 <= rank < size:
        raise ValueError(f"{field} must be an integer in [0, {size}): this server runs {size} "
                         f"data-parallel replica{'s' if size != 1 else ''} (got {rank!r})")
    return rank


def replica_args(engine_args: EngineArgs, rank: int, port: int | None = None) -> EngineArgs:
    """The engine arguments of replica `rank`: its own GPU(s), or its share of the cores,
    and its rank (its KV events say which replica they come from, on their own port); DP+EP:
    the port the replicas' process group meets on."""
    dp = engine_args.data_parallel_size
    engine_args = dataclasses.replace(engine_args, data_parallel_rank=rank)
    if engine_args.enable_expert_parallel is True:
        engine_args = dataclasses.replace(engine_args, data_parallel_master_port=port)
    device = engine_args.device
    if device is None:
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        first = int(device.split(":")[1]) if ":" in device else 0
        world = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
        device = f"cuda:{first + rank * world}"
        return dataclasses.replace(engine_args, device=device)
    threads = engine_args.cpu_threads or max(1, (usable_cores() - 1) // dp)
    return dataclasses.replace(engine_args, device=device, cpu_threads=threads)


def merge_limits(limits: list[EngineLimits]) -> EngineLimits:
    """What a request is validated against: it must fit any replica's KV pool; the server as
    a whole runs every replica's batch."""
    return msgspec.structs.replace(limits[0], num_kv_blocks=min(x.num_kv_blocks for x in limits),
                                   max_num_seqs=sum(x.max_num_seqs for x in limits))


class DataParallelCoreClient:
    def __init__(self, clients: list[EngineCoreClient], *, lockstep: bool = False):
        self.clients = clients
        # DP+EP: the replicas share every MoE layer, so none can serve without the others
        self.lockstep = lockstep
        self._dead_callbacks: list[Callable[[], None]] = []
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
        return cls(clients, lockstep=engine_args.enable_expert_parallel is True)

    async def wait_ready(self, timeout: float | None = None) -> Ready:
        readies = await asyncio.gather(*(c.wait_ready(timeout) for c in self.clients))
        for rank, r in enumerate(readies):
            logger.info("engine replica %d of %d: pid %d", rank, len(readies), r.pid)
        return Ready(merge_limits([r.limits for r in readies]), pid=readies[0].pid)

    # ---- traffic --------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        """To the replica the request names, else the least loaded; a named replica that
        died leaves the choice to the load (its prefix is gone with it)."""
        live = self._live_ranks()
        if not live:
            raise EngineDeadError("every engine replica has died")
        named = check_data_parallel_rank(req.data_parallel_rank, len(self.clients))
        if named is not None and named in live:
            rank = named
        else:
            if named is not None:
                logger.debug("request %s names replica %d, which died: balanced instead",
                             req.request_id, named)
            rank = min(live, key=lambda i: (self._in_flight[i], i))
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
            if not self.clients[rank].dead:
                self.clients[rank].abort_requests(ids)

    async def call_utility(self, method: str, timeout: float = 10.0, args: list[Any] | None = None
                           ) -> Any:
        """On every replica still running (results[0] is the first of them)."""
        live = [self.clients[i] for i in self._live_ranks()]
        if not live:
            raise EngineDeadError("every engine replica has died")
        results = await asyncio.gather(*(c.call_utility(method, timeout, args) for c in live))
        if method == "get_stats":
            stats = [msgspec.convert(r, SchedulerStats) for r in results]
            return msgspec.to_builtins(merge_engine_stats(stats, stats[0]))
        return results[0]

    async def get_outputs(self) -> CoreOutputs:
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self._outputs.put_nowait(item)
            raise item
        return item

    def on_dead(self, callback: Callable[[], None]) -> None:
        """`callback` runs once the server can no longer serve: when any replica dies under
        DP+EP, otherwise when the last one does."""
        if not self._dead_callbacks:
            for c in self.clients:
                c.on_dead(self._replica_died)
        self._dead_callbacks.append(callback)

    def engine_of(self, request_id: str) -> int:
        return self._owner.get(request_id, 0)

    @property
    def dead(self) -> bool:
        deaths = [c.dead for c in self.clients]
        return any(deaths) if self.lockstep else all(deaths)

    @property
    def is_alive(self) -> bool:
        alive = [c.is_alive for c in self.clients]
        return all(alive) if self.lockstep else any(alive)

    @property
    def max_num_seqs(self) -> int:
        """The sequences the replicas still running batch together: a dead replica's share
        leaves the frontend's queue limit (max_num_seqs + max_waiting_requests) with it,
        while the others keep serving (wait_ready's merged limits count every replica)."""
        return sum(c.max_num_seqs for c in self.clients)  # a dead client's is 0

    async def shutdown(self, timeout: float = 5.0) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*(c.shutdown(timeout) for c in self.clients))

    # ---- internals ------------------------------------------------------------------------
    def _live_ranks(self) -> list[int]:
        return [i for i, c in enumerate(self.clients) if not c.dead]

    def _replica_died(self) -> None:
        if not self.dead:
            return  # the others keep serving; _forward fails the lost replica's requests
        callbacks, self._dead_callbacks = self._dead_callbacks, []
        for cb in callbacks:
            try:
                cb()
            except Exception:
                logger.exception("engine-death callback failed")

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
                if self.dead:  # nothing left that can serve
                    self._outputs.put_nowait(e)
                    return
                lost = [rid for rid, r in self._owner.items() if r == rank]
                for rid in lost:
                    self._release(rid)
                # its gauges drop to zero; its counters stay (a Prometheus counter never falls)
                last = SchedulerStats(**{f: getattr(self._latest[rank], f)
                                         for f in CUMULATIVE_FIELDS},
                                      kv_tiers=self._latest[rank].kv_tiers)
                logger.error("engine replica %d died (%s): %d requests lost, %d replicas "
                             "still serving", rank, e, len(lost), len(self._live_ranks()))
                self._outputs.put_nowait(CoreOutputs(
                    EngineCoreOutputs(stats=last), engine_index=rank,
                    lost={rid: f"engine replica {rank} died: {e}" for rid in lost}))
                return
            for out in msg.outputs.outputs:
                if out.finish_reason is not None:
                    self._release(out.request_id)
            for rid in msg.rejected:
                self._release(rid)
            if msg.outputs.stats is not None:
                self._latest[rank] = msg.outputs.stats
            msg.engine_index = rank
            self._outputs.put_nowait(msg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
