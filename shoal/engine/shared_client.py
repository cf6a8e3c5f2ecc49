"""A frontend's handle on a shared engine-core process (engine/shared_core.py): what
EngineCoreClient is for an engine of its own, over one DEALER socket.

The supervisor of `shoal serve --api-server-count N` starts the engine and is its owner
client: it gets the engine's statistics every step and alone may stop it. Each API process
attaches to the running engine by address and pid; it watches the engine through a pidfd (the
engine is not its child), and its shutdown only detaches it. A client sends on a DEALER socket
and receives on a PULL socket of its own (shared_core.py says why).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import shutil
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from shoal.engine.core_client import EngineCoreClient, spawn_engine_process
from shoal.engine.engine_args import EngineArgs
from shoal.engine.shared_core import Detach, Hello, run_shared_engine_core
from shoal.temp_folders import make_temp_folder


class ForeignProcess:
    """The engine process seen from a process that is not its parent: a pidfd that turns
    readable when it exits (what multiprocessing's sentinel is for a child)."""

    def __init__(self, pid: int):
        self.pid = pid
        try:
            self.sentinel = os.pidfd_open(pid)
        except (AttributeError, OSError) as e:
            raise OSError(f"cannot watch the engine process {pid} (pidfd_open needs Linux "
                          f"5.3+): {e}") from None
        self.exitcode: int | None = None  # (only a parent learns it)

    def is_alive(self) -> bool:
        return not select.select([self.sentinel], [], [], 0)[0]

    def join(self, timeout: float | None = None) -> None:
        pass

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.sentinel)


class SharedCoreClient(EngineCoreClient):
    owner = False
    address = ""  # the engine's
    _own_dir: str | None = None  # an attached client's socket folder

    @classmethod
    async def start(cls, engine_args: EngineArgs, log_level: int = logging.INFO,
                    build_core: Callable[[EngineArgs], Any] | None = None) -> SharedCoreClient:
        """Spawns a shared engine and attaches to it as its owner; `address` and `proc.pid`
        are what API processes attach with."""
        ipc_dir = make_temp_folder("ipc")
        address = f"ipc://{ipc_dir}/engine"
        proc, death_writer = spawn_engine_process(
            engine_args, run_shared_engine_core, (address,), log_level, build_core)
        return cls._attach(address, proc, owner=True, death_writer=death_writer,
                           ipc_dir=ipc_dir)

    @classmethod
    def attach(cls, address: str, engine_pid: int) -> SharedCoreClient:
        """An API process's client of the engine another process started."""
        own_dir = make_temp_folder("ipc")
        client = cls._attach(address, ForeignProcess(engine_pid), owner=False, out_dir=own_dir)
        client._own_dir = own_dir
        return client

    @classmethod
    def _attach(cls, address: str, proc: Any, *, owner: bool, death_writer: Any = None,
                ipc_dir: str | None = None, out_dir: str | None = None) -> SharedCoreClient:
        ctx = zmq.asyncio.Context()
        to_engine = ctx.socket(zmq.DEALER)
        to_engine.connect(address)
        from_engine = ctx.socket(zmq.PULL)
        from_engine.setsockopt(zmq.RCVHWM, 0)  # the engine never waits on this side
        output_address = f"ipc://{out_dir or ipc_dir}/output-{os.getpid()}"
        from_engine.bind(output_address)
        client = cls(proc, death_writer, ipc_dir or "", ctx, to_engine, from_engine)
        client.owner = owner
        client.address = address
        client._enqueue(Hello(os.getpid(), output_address, owner))
        client._watch()
        return client

    async def shutdown(self, timeout: float = 5.0) -> None:
        """The owner stops the engine (EngineCoreClient's shutdown); any other client
        detaches, its requests aborted in the engine, which goes on serving the rest."""
        if self.owner:
            await super().shutdown(timeout)
            return
        self.closing = True
        if not self.dead:
            with contextlib.suppress(Exception):
                self._enqueue(Detach())
                await asyncio.wait_for(self._send_queue.join(), 1.0)
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(self.proc.sentinel)
        for t in self._tasks:
            t.cancel()
        self._to_engine.close(linger=1000)  # (the Detach may still be on its way)
        self._from_engine.close(linger=0)
        self._ctx.term()
        self.proc.close()
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
