"""The frontend's handle on the engine-core process: start it, talk to it, notice its death.

Sockets are `ipc://` files in a private temp dir. Sends go through one writer task, so callers
(abort in a `finally:` above all) never have to await; a reader task routes outputs to a queue
and utility results to their futures. The process sentinel is watched by the event loop: when
the engine dies, every waiter gets EngineDeadError at once instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import multiprocessing
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from shoal.core.types import EngineCoreRequest
from shoal.engine.core_messages import (
    AbortRequests,
    AddRequest,
    CoreOutputs,
    OutputMessage,
    Ready,
    Shutdown,
    StartupFailed,
    UtilityCall,
    UtilityResult,
)
from shoal.engine.core_proc import run_engine_core
from shoal.engine.cpu_threads import spawn_env
from shoal.engine.engine_args import EngineArgs
from shoal.engine.request_errors import EngineDeadError
from shoal.temp_folders import make_temp_folder

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def spawn_environment(extra: dict[str, str]) -> Iterator[None]:
    """os.environ plus `extra` while a process is spawned (it copies the environment), then
    as it was."""
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def spawn_engine_process(engine_args: EngineArgs, target: Callable[..., None],
                         addresses: tuple[str, ...], log_level: int,
                         build_core: Callable[[EngineArgs], Any] | None) -> tuple[Any, Any]:
    """Starts `target(engine_args, *addresses, death_pipe, parent_pid, log_level[,
    build_core])` in a spawned process: the process and the write end of its death pipe
    (closing it, or this process dying, tells the engine to exit)."""
    mp = multiprocessing.get_context("spawn")
    death_reader, death_writer = mp.Pipe(duplex=False)
    proc = mp.Process(
        # A daemonic process may not start processes: with tensor parallelism the core
        # starts its worker ranks. It still exits with the frontend (the death pipe).
        target=target, name="shoal-engine-core",
        daemon=(engine_args.tensor_parallel_size == 1
                and engine_args.pipeline_parallel_size == 1
                and engine_args.distributed_executor_backend in (None, "uni")),
        args=(engine_args, *addresses, death_reader, os.getpid(), log_level,
              *([build_core] if build_core is not None else [])),
    )
    with spawn_environment(spawn_env()):  # the child's OpenMP reads it at start-up
        proc.start()
    death_reader.close()
    return proc, death_writer


class EngineStartupError(RuntimeError):
    """The engine process failed to start; the message is its exception text."""


class EngineCoreClient:
    def __init__(self, proc: Any, death_writer: Any, ipc_dir: str, ctx: zmq.asyncio.Context,
                 in_sock: zmq.asyncio.Socket, out_sock: zmq.asyncio.Socket):
        self.proc = proc
        self._death_writer = death_writer  # closing it (or dying) tells the engine to exit
        self._ipc_dir = ipc_dir
        self._ctx = ctx
        self._to_engine = in_sock
        self._from_engine = out_sock
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(OutputMessage)
        self._send_queue: asyncio.Queue[bytes] = asyncio.Queue()
        # The same ZMQ socket, blocking API: a message goes out from _enqueue itself when
        # nothing is queued before it. Through the writer task alone, a burst of requests
        # read in one event-loop turn reached the engine only after every one of them had
        # been parsed (W8's first 256 arrivals: 225 in one lump, 0.29 s after the first).
        self._direct = zmq.Socket.shadow(in_sock.underlying)
        self._writer_busy = False
        self._outputs: asyncio.Queue[CoreOutputs | BaseException] = asyncio.Queue()
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count()
        self._ready: asyncio.Future[Ready] = asyncio.get_running_loop().create_future()
        # Nobody may be waiting when start-up fails (the frontend failed first): mark the
        # error as seen so asyncio does not log it a second time.
        self._ready.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._dead_callbacks: list[Callable[[], None]] = []
        self.dead = False
        self.closing = False
        self._tasks: list[asyncio.Task[None]] = []

    # ---- start-up -------------------------------------------------------------------------
    @classmethod
    async def start(cls, engine_args: EngineArgs, log_level: int = logging.INFO,
                    build_core: Callable[[EngineArgs], Any] | None = None) -> EngineCoreClient:
        """Spawns the engine process; `wait_ready()` then waits for its READY message.
        `build_core` replaces the model-loading EngineCore (a picklable callable: tests and
        the model-free serving benchmark)."""
        ipc_dir = make_temp_folder("ipc")
        input_addr, output_addr = f"ipc://{ipc_dir}/input", f"ipc://{ipc_dir}/output"
        ctx = zmq.asyncio.Context()
        to_engine = ctx.socket(zmq.PUSH)
        to_engine.bind(input_addr)
        from_engine = ctx.socket(zmq.PULL)
        from_engine.setsockopt(zmq.RCVHWM, 0)  # the engine never waits on this side
        from_engine.bind(output_addr)
        proc, death_writer = spawn_engine_process(
            engine_args, run_engine_core, (input_addr, output_addr), log_level, build_core)
        client = cls(proc, death_writer, ipc_dir, ctx, to_engine, from_engine)
        client._watch()
        return client

    def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_reader(self.proc.sentinel, self._on_process_exit)
        self._tasks = [loop.create_task(self._reader(), name="engine-reader"),
                       loop.create_task(self._writer(), name="engine-writer")]

    async def wait_ready(self, timeout: float | None = None) -> Ready:
        try:
            return await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        except TimeoutError:
            raise EngineStartupError(f"the engine did not start within {timeout} s") from None

    # ---- traffic --------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest) -> None:
        self._enqueue(AddRequest(req))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and not self.dead:
            self._enqueue(AbortRequests(request_ids))

    async def call_utility(self, method: str, timeout: float = 10.0, args: list[Any] | None = None
                           ) -> Any:
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = fut
        self._enqueue(UtilityCall(call_id, method, list(args or ())))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._calls.pop(call_id, None)

    async def get_outputs(self) -> CoreOutputs:
        item = await self._outputs.get()
        if isinstance(item, BaseException):
            self._outputs.put_nowait(item)  # every later caller sees it too
            raise item
        return item

    def on_dead(self, callback: Callable[[], None]) -> None:
        self._dead_callbacks.append(callback)

    def engine_of(self, request_id: str) -> int:
        """The replica running a request: there is one."""
        return 0

    @property
    def is_alive(self) -> bool:
        return not self.dead and self.proc.is_alive()

    @property
    def max_num_seqs(self) -> int:
        """The sequences this engine batches (its ready message's max_num_seqs); 0 before it
        is ready and once it has died. The frontend's queue limit is this plus
        max_waiting_requests."""
        ready = self._ready
        if self.dead or not ready.done() or ready.cancelled() or ready.exception() is not None:
            return 0
        return ready.result().limits.max_num_seqs

    def _enqueue(self, msg: Any) -> None:
        if self.dead:
            raise EngineDeadError("the engine process is not running")
        data = self._encoder.encode(msg)
        if not self._writer_busy and self._send_queue.empty():  # keeps messages in order
            try:
                self._direct.send(data, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:  # the pipe is full: the writer waits for room
                pass
        self._send_queue.put_nowait(data)

    async def _writer(self) -> None:
        while True:
            data = await self._send_queue.get()
            self._writer_busy = True
            try:
                await self._to_engine.send(data, copy=False)
            finally:
                self._writer_busy = False
                self._send_queue.task_done()

    async def _reader(self) -> None:
        while True:
            frame = await self._from_engine.recv(copy=False)
            try:
                msg = self._decoder.decode(frame.buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.error("dropping a malformed message from the engine: %s", e)
                continue
            if isinstance(msg, CoreOutputs):
                self._outputs.put_nowait(msg)
            elif isinstance(msg, UtilityResult):
                self._resolve(msg)
            elif isinstance(msg, Ready):
                if not self._ready.done():
                    self._ready.set_result(msg)
            elif isinstance(msg, StartupFailed) and not self._ready.done():
                self._ready.set_exception(EngineStartupError(msg.message))

    def _resolve(self, msg: UtilityResult) -> None:
        fut = self._calls.get(msg.call_id)
        if fut is None or fut.done():
            return
        if msg.error is not None:
            fut.set_exception(RuntimeError(msg.error))
        else:
            fut.set_result(msg.result)

    # ---- death and shutdown ---------------------------------------------------------------
    def _on_process_exit(self) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(self.proc.sentinel)
        # Let the reader pick up what the engine sent before it died (its startup error
        # above all) before declaring everything dead.
        loop.call_later(0.2, self._mark_dead)

    def _mark_dead(self) -> None:
        if self.dead:
            return
        self.dead = True
        self.proc.join(0)
        code = self.proc.exitcode
        if not self.closing:
            logger.error("the engine core process died (exit code %s)", code)
        err = EngineDeadError(f"the engine process died (exit code {code})")
        if not self._ready.done():
            self._ready.set_exception(EngineStartupError(
                f"the engine process exited during start-up (exit code {code})"))
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._outputs.put_nowait(err)
        if self.closing:
            return  # an exit we asked for
        for cb in self._dead_callbacks:
            try:
                cb()
            except Exception:
                logger.exception("engine-death callback failed")

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Asks the engine to stop, then escalates; safe to call more than once."""
        self.closing = True
        if self.proc.is_alive() and not self.dead:
            with contextlib.suppress(Exception):
                self._enqueue(Shutdown())
                await asyncio.wait_for(self._send_queue.join(), 1.0)
            await asyncio.to_thread(self.proc.join, timeout)
        if self.proc.is_alive():
            self.proc.terminate()
            await asyncio.to_thread(self.proc.join, 2.0)
        if self.proc.is_alive():
            self.proc.kill()
            await asyncio.to_thread(self.proc.join, 2.0)
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.proc.sentinel)
        for t in self._tasks:
            t.cancel()
        self._death_writer.close()
        self._to_engine.close(linger=0)
        self._from_engine.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
