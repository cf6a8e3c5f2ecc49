"""`shoal serve --api-server-count N` (N > 1): N API processes over one engine-core process.

    supervisor (this module) --owner--> engine core (shared_core.py) <--clients-- API 0..N-1

The supervisor starts the engine, then the API processes at once (their imports and
tokenizer load overlap the model load); each runs the one-process server (api_server.serve)
on its own event loop, attached to the engine as a client (shared_client.py). The
supervisor records the engine's statistics for /metrics and the log line
(pool_metrics.py), forwards SIGTERM/SIGINT to the API processes, and stops the engine once
they have all drained and exited.

Listening: each API process binds its own socket to host:port with SO_REUSEPORT, and the
kernel shares new connections out between them by a hash of each connection's addresses. One
socket bound here and inherited (uvicorn --workers, gunicorn) has a single accept queue that
goes to whichever process wakes first, and asyncio accepts up to its backlog per wake-up, so a
burst of connections (W8's clients, all at once) would land on one process. The supervisor
binds the port first (SO_REUSEPORT too, never listening, so it gets no connection): a port in
use fails before anything starts, and port 0 becomes one port for all.

An API process that dies takes its own requests with it (the engine aborts them, and the
supervisor zeroes its /load cell); the others and the engine go on, and the supervisor starts
a new process on its index: a new client of the engine (its own namespace of request ids),
binding the same port, which the supervisor's socket keeps reserved; it listens only once it
serves, so no new connection waits on its start-up (it answers 3 s after the death on 2 busy
CPU cores; listening from its bind, as at the first start, a connection queued on it waited up
to 0.7 s). The dead pid's metric files stay, so counters and histograms keep counting what it
served (prometheus_client's mark_process_dead drops only its "live" gauges). Each restart is
logged with the exit code or signal and counted in
shoal:api_server_restarts_total{api_server}; any exit the supervisor did not ask for counts (a
SIGTERM sent to one API process too). Restarts are bounded (RestartBudget): an index already
restarted 5 times within the last 60 s is left dead when it dies again, with a log line saying
so; the supervisor exits 1 once no API process is left. Nothing is restarted once
SIGTERM/SIGINT has come, nor after the engine died: then every API process fails its requests
and exits 1 (as a one-process server does), then the supervisor.

One server to its clients, whichever process a request lands on: the engine's state (sleep,
pause, prefix cache, weights) is the engine's; /metrics merges every process's series
(pool_metrics.py); and pool_state.py holds what the API processes share besides, created here
before they start and removed at exit: the Responses API store (stored responses, the
conversations of previous_response_id, GET /v1/responses/{id}), the /load count of requests in
flight on the whole server (a dead process's share zeroed here), and the LoRA adapters loaded
or unloaded at run time (one table, one id per adapter for the engine). What stays per
process: its x-shoal-api-server header and shoal:api_server_requests_total series, which say
which process served what. Refused at start: --data-parallel-size, --uds, --grpc-port.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client.multiprocess import mark_process_dead

from shoal.engine.core_client import EngineStartupError
from shoal.engine.engine_args import EngineArgs
from shoal.engine.request_errors import EngineDeadError
from shoal.engine.shared_client import SharedCoreClient
from shoal.entrypoints.openai.lora_routes import parse_lora_modules
from shoal.entrypoints.openai.pool_metrics import (
    PoolMember,
    enable_multiprocess_metrics,
    restart_counter,
)
from shoal.entrypoints.openai.pool_restart import RestartBudget, describe_exit
from shoal.entrypoints.openai.pool_state import PoolShared
from shoal.entrypoints.openai.pool_state import join as join_pool
from shoal.entrypoints.openai.server_settings import ServerSettings
from shoal.metrics.stats import IterationStats
from shoal.temp_folders import make_temp_folder

logger = logging.getLogger("shoal.entrypoints.openai.api_server")

LISTEN_BACKLOG = 4096
STATS_LOG_INTERVAL_S = 10.0


def check_pool_settings(engine_args: EngineArgs, settings: ServerSettings) -> None:
    """What several API processes cannot do: a ValueError naming the flag."""
    n = settings.api_server_count
    if engine_args.data_parallel_size > 1:
        raise ValueError(f"--api-server-count {n} shares one engine core between API "
                         f"processes; it does not combine with --data-parallel-size "
                         f"{engine_args.data_parallel_size}")
    if settings.uds:
        raise ValueError(f"--api-server-count {n} listens on --host/--port (SO_REUSEPORT); "
                         "a unix socket (--uds) is served by one API process")
    if settings.grpc_port:
        raise ValueError(f"--grpc-port is served by one process; it does not combine with "
                         f"--api-server-count {n}")
    parse_lora_modules(settings.lora_modules or [])  # (the supervisor reads them too)
    if not hasattr(socket, "SO_REUSEPORT") or not hasattr(os, "pidfd_open"):
        raise ValueError(f"--api-server-count {n} needs Linux (SO_REUSEPORT, pidfd_open)")


def bind_reuseport(host: str, port: int) -> socket.socket:
    """A TCP socket bound to host:port that other SO_REUSEPORT sockets may share."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


@dataclass(frozen=True)
class ApiProcessSpec:
    """What API process `index` needs (pickled to it at spawn)."""

    index: int
    engine_args: EngineArgs
    settings: ServerSettings  # its port resolved
    engine_address: str
    engine_pid: int
    metrics_dir: str
    log_level: int
    shared: PoolShared
    # At the first start each process listens from its bind: connections queue on one still
    # starting, so the kernel shares them out from the first (none is served before the
    # engine is ready anyway). A restarted one listens only once it serves (uvicorn's
    # listen): meanwhile new connections go to the others instead of waiting in its queue.
    listen_early: bool = True


def run_api_process(spec: ApiProcessSpec) -> None:
    """Entry point of an API process (a `multiprocessing` spawn target)."""
    # Its own process group: Ctrl-C reaches the supervisor alone, which sends one SIGTERM
    # (a second signal would make uvicorn skip the drain).
    os.setpgrp()
    logging.basicConfig(level=spec.log_level,
                        format=f"%(levelname)s %(asctime)s [api {spec.index}] %(message)s")
    enable_multiprocess_metrics(spec.metrics_dir)
    join_pool(spec.shared, spec.index)
    try:
        sock = bind_reuseport(spec.settings.host, spec.settings.port)
        if spec.listen_early:
            sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        print(f"shoal: API process {spec.index}: {e}", file=sys.stderr)
        sys.exit(1)
    sys.exit(asyncio.run(_serve_one(spec, sock)))


async def _serve_one(spec: ApiProcessSpec, sock: socket.socket) -> int:
    from shoal.entrypoints.openai.api_server import serve

    try:
        client = SharedCoreClient.attach(spec.engine_address, spec.engine_pid)
    except OSError as e:
        print(f"shoal: API process {spec.index}: {e}", file=sys.stderr)
        return 1
    return await serve(spec.engine_args, spec.settings, client=client, sockets=[sock],
                       pool=PoolMember(spec.index, spec.metrics_dir))


class ApiServerPool:
    def __init__(self, engine_args: EngineArgs, settings: ServerSettings,
                 owner: SharedCoreClient, metrics_dir: str, log_level: int,
                 shared: PoolShared, budget: RestartBudget | None = None):
        self.engine_args = engine_args
        self.settings = settings
        self.owner = owner
        self.metrics_dir = metrics_dir
        self.log_level = log_level
        self.shared = shared
        self.budget = budget or RestartBudget()
        self.workers: list[Any] = []  # workers[k]: API process k's latest process
        self._reaping: set[asyncio.Task[None]] = set()
        self.all_exited = asyncio.Event()
        self.stopping = False
        self.engine_died = False
        self.restarts = restart_counter(settings.api_server_count)

    def spawn(self) -> None:
        for index in range(self.settings.api_server_count):
            self.workers.append(None)
            self._start(index, restart=False)

    def _start(self, index: int, restart: bool) -> None:
        spec = ApiProcessSpec(index, self.engine_args, self.settings, self.owner.address,
                              self.owner.proc.pid, self.metrics_dir, self.log_level,
                              self.shared, listen_early=not restart)
        proc = multiprocessing.get_context("spawn").Process(
            target=run_api_process, args=(spec,), name=f"shoal-api-{index}", daemon=True)
        proc.start()
        self.workers[index] = proc
        asyncio.get_running_loop().add_reader(proc.sentinel, self._exited, index, proc)

    def _exited(self, index: int, proc: Any) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(proc.sentinel)
        task = loop.create_task(self._reap(index, proc))
        self._reaping.add(task)
        task.add_done_callback(self._reaping.discard)

    async def _reap(self, index: int, proc: Any) -> None:
        # The sentinel turns readable as the process closes its files, a moment before the
        # kernel has its exit status.
        await asyncio.to_thread(proc.join, 10.0)
        self.shared.process_gone(index)
        mark_process_dead(proc.pid, self.metrics_dir)
        if self._may_restart():
            how = describe_exit(proc.exitcode)
            if not self.budget.take(index, time.monotonic()):
                logger.error("API server process %d (pid %d) died (%s) after %d restarts "
                             "within %.0f s; it is not restarted again; %d left", index,
                             proc.pid, how, self.budget.recent(index), self.budget.window_s,
                             self._left())
            elif await self._backed_off(index, proc.pid, how):
                try:
                    self._start(index, restart=True)
                except OSError as e:  # (no process or pipe to be had: as if given up)
                    logger.error("API server process %d (pid %d) died (%s) and cannot be "
                                 "restarted: %s; %d left", index, proc.pid, how, e,
                                 self._left())
                else:
                    self.restarts[index].inc()
                    logger.warning("API server process %d (pid %d) died (%s); restarted as "
                                   "pid %d (restart %d of %d allowed within %.0f s)", index,
                                   proc.pid, how, self.workers[index].pid,
                                   self.budget.recent(index), self.budget.limit,
                                   self.budget.window_s)
                    return
        if not self._left():
            self.all_exited.set()

    async def _backed_off(self, index: int, pid: int, how: str) -> bool:
        """Waits the budget's back-off before a repeated restart; False if the server began
        stopping (or lost its engine) meanwhile. The check and the start that follows run in
        one step of the loop: stop() cannot come between them."""
        wait = self.budget.backoff_s(index)
        if wait > 0:
            logger.warning("API server process %d (pid %d) died (%s) again; restarting it in "
                           "%.1f s", index, pid, how, wait)
            await asyncio.sleep(wait)
        return self._may_restart()

    def _may_restart(self) -> bool:
        """Not while shutting down, nor once the engine is gone (the API processes then exit
        on their own, and a new one would find no engine)."""
        return not self.stopping and not self.engine_died and self.owner.is_alive

    def _left(self) -> int:
        return sum(w.is_alive() for w in self.workers)

    def stop(self) -> None:
        """SIGTERM/SIGINT: each API process drains (--shutdown-timeout), then exits; a second
        signal reaches them too, and uvicorn then stops at once."""
        self.stopping = True
        for w in self.workers:
            if w.is_alive():
                w.terminate()

    def on_engine_death(self) -> None:
        self.engine_died = True  # the API processes notice it themselves and exit
        logger.error("the engine process died; the API processes shut down")

    async def record_stats(self, loggers: list[Any]) -> None:
        """The engine's statistics of every step, recorded once (pool_metrics.py)."""
        try:
            while True:
                msg = await self.owner.get_outputs()
                if msg.outputs.stats is not None:
                    for sl in loggers:
                        sl.record(msg.outputs.stats, IterationStats(), msg.engine_index)
        except EngineDeadError:
            return

    async def log_stats(self, loggers: list[Any]) -> None:
        while True:
            await asyncio.sleep(STATS_LOG_INTERVAL_S)
            for sl in loggers:
                sl.log()


def engine_loggers(engine_args: EngineArgs, settings: ServerSettings, ready: Any) -> list[Any]:
    """The supervisor's stat loggers: the engine's series for /metrics, and the log line."""
    from prometheus_client import CollectorRegistry

    from shoal.entrypoints.openai.api_server import served_names
    from shoal.metrics import LoggingStatLogger, PrometheusStatLogger
    from shoal.metrics.cache_info import cache_config_info

    return [PrometheusStatLogger(served_names(engine_args, settings)[0], CollectorRegistry(),
                                 prefixes=settings.metrics_prefixes,
                                 max_model_len=ready.limits.max_model_len,
                                 cache_info=cache_config_info(ready.limits, engine_args)),
            *([] if engine_args.disable_log_stats else [LoggingStatLogger()])]


async def serve_pool(engine_args: EngineArgs, settings: ServerSettings,
                     build_core: Any = None) -> int:
    """Runs the pool until SIGTERM/SIGINT (0) or until no API process is left (1)."""
    check_pool_settings(engine_args, settings)
    try:
        holder = bind_reuseport(settings.host, settings.port)
    except OSError as e:
        print(f"shoal: cannot listen on {settings.host}:{settings.port}: {e}", file=sys.stderr)
        return 1
    settings = dataclasses.replace(settings, port=holder.getsockname()[1])
    metrics_dir = make_temp_folder("metrics")
    enable_multiprocess_metrics(metrics_dir)
    log_level = logging.getLogger().getEffectiveLevel()
    try:
        owner = await SharedCoreClient.start(engine_args, log_level=log_level,
                                             build_core=build_core)
        shared: PoolShared | None = None
        try:
            shared = PoolShared.create(  # (while the engine starts)
                settings, parse_lora_modules(settings.lora_modules or []))
            return await _supervise(ApiServerPool(engine_args, settings, owner, metrics_dir,
                                                  log_level, shared))
        finally:
            await owner.shutdown()
            if shared is not None:
                shared.remove()
    finally:
        holder.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)


async def _supervise(pool: ApiServerPool) -> int:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, pool.stop)
    pool.spawn()
    try:
        ready = await pool.owner.wait_ready()
    except EngineStartupError as e:
        logger.error("the engine failed to start: %s", e)
        print(f"shoal: the engine failed to start: {e}", file=sys.stderr)
        pool.stop()
        await pool.all_exited.wait()
        return 1
    logger.info("engine core ready (pid %d); %d API server processes on %s:%d", ready.pid,
                len(pool.workers), pool.settings.host, pool.settings.port)
    pool.owner.on_dead(pool.on_engine_death)
    loggers = engine_loggers(pool.engine_args, pool.settings, ready)
    tasks = [loop.create_task(pool.record_stats(loggers)),
             loop.create_task(pool.log_stats(loggers[1:]))]
    try:
        await pool.all_exited.wait()
    finally:
        for t in tasks:
            t.cancel()
    return 0 if pool.stopping and not pool.engine_died else 1
