"""Tensor and pipeline parallelism over processes on this host (vLLM's `mp` executor).

Rank 0 is a ModelRunner in the engine core's own process (the driver); ranks 1..N-1 are
spawned worker processes (shoal/executor/worker.py), joined with it in one process group
(NCCL on GPUs, gloo on the CPU). Every step the driver sends the SchedulerOutput to the
workers over ZMQ (msgpack), then runs it itself; the all-reduces and gathers inside the model
keep the ranks in lockstep, and only rank 0's sampled tokens are returned. The scheduler runs
synchronously with more than one rank (EngineArgs turns async scheduling off; pipeline
micro-batches never hold one request twice), so every rank's input tokens come from the
scheduler, never from a rank's own sampling.

Pipeline parallelism: world = tp * pp, rank r is stage r // tp. Each stage runs its layers on
the step's tokens as they arrive from the previous stage (shoal/worker/stage_link.py); the
last stage sends its final hidden states back to stage 0, which holds lm_head and samples.
The engine keeps up to pp steps in flight (engine/step_queue.py): execute() returns once stage
0 has sent a step on, finish() (FinishStep to the ranks) waits for the last stage and samples,
so stage 0 runs micro-batch N+1 while the later stages run N (shoal/executor/driver.py).

Shutdown: rank 0 leaves its process group, then stops the workers, through shutdown() or, for
an executor never shut down (a failed start, an engine dropped or alive at exit, an engine
shutdown that raised), through a finalizer that runs at the latest at interpreter exit, while
torch.distributed still works; release_all() does the same for a process that ends with
os._exit."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import shutil
import weakref
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq

from shoal.config import EngineConfig
from shoal.distributed.parallel_state import reset_tensor_parallel
from shoal.executor.commands import Stop
from shoal.executor.distributed_init import free_port, join_tensor_parallel_group
from shoal.executor.driver import DriverExecutor
from shoal.executor.rank_runner import model_runner
from shoal.executor.worker import run_worker
from shoal.loader import LoadedModel
from shoal.temp_folders import make_temp_folder


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone: no step can run any more."""


SEND_TIMEOUT_MS = 1000  # a command a worker does not take this long: are the workers alive?


class _Ranks:
    """What rank 0 holds of the ranks: the worker processes, their command sockets, the IPC
    folder and its own membership of the process group. Kept apart from the executor so
    that its finalizer, which must not hold the executor, can release them."""

    def __init__(self) -> None:
        self.ipc_dir = make_temp_folder("tp")
        self.ctx = zmq.Context()
        self.sockets: list[zmq.Socket] = []
        self.procs: list[Any] = []
        self.joined = False  # this process is joining, or joined, the group
        _UNRELEASED.add(self)

    def release(self) -> None:
        """Stops the workers and leaves the process group; idempotent. Rank 0 leaves before
        it waits for the workers to exit (up to 10 s each): a server's frontend kills an
        engine process that takes longer than a few seconds to exit, and a group still
        alive at teardown is destroyed there, where NCCL warns that it was not."""
        _UNRELEASED.discard(self)
        try:
            stop = msgspec.msgpack.Encoder().encode(Stop())
            for sock, proc in zip(self.sockets, self.procs):
                if proc.is_alive():
                    try:
                        sock.send(stop, zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass
        finally:
            self._leave_group()
            self._stop_workers()

    def _leave_group(self) -> None:
        if self.joined:
            self.joined = False
            if dist.is_initialized():
                dist.destroy_process_group()
            reset_tensor_parallel()

    def _stop_workers(self) -> None:
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for sock in self.sockets:
            sock.close(linger=0)
        self.sockets, self.procs = [], []
        if not self.ctx.closed:
            self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


# Ranks not released yet, for release_all (strong references: a _Ranks holds no executor).
_UNRELEASED: set[_Ranks] = set()


def release_all() -> None:
    """Releases the ranks of every executor of this process not shut down yet. A process that
    ends with os._exit (the server's engine process, shoal/engine/core_proc.py) runs no
    finalizer and no atexit callback: it calls this first."""
    for ranks in list(_UNRELEASED):
        ranks.release()


class MultiprocExecutor(DriverExecutor):
    def __init__(self, config: EngineConfig, loaded: LoadedModel):
        pc = config.parallel_config
        pp = pc.pipeline_parallel_size
        world = pc.tensor_parallel_size * pp
        self.world = world
        threads = None
        if config.device.type == "cpu":  # the ranks share this process's cores
            threads = max(1, torch.get_num_threads() // world)
            torch.set_num_threads(threads)
        self._ranks = ranks = _Ranks()
        # At garbage collection or at interpreter exit, whichever comes first (an engine
        # dropped without shutdown, a failed start, an engine shutdown that raised): before
        # the interpreter tears down, while torch.distributed still works.
        self._finalizer = weakref.finalize(self, ranks.release)
        self._encoder = msgspec.msgpack.Encoder()
        port = free_port()
        mp = multiprocessing.get_context("spawn")
        try:
            for rank in range(1, world):
                addr = f"ipc://{ranks.ipc_dir}/rank{rank}"
                sock = ranks.ctx.socket(zmq.PUSH)
                sock.bind(addr)
                ranks.sockets.append(sock)
                proc = mp.Process(target=run_worker, name=f"shoal-tp-rank{rank}", daemon=True,
                                  args=(config, rank, world, port, addr, threads, pp))
                proc.start()
                ranks.procs.append(proc)
            ranks.joined = True  # from here on, leaving checks dist.is_initialized()
            join_tensor_parallel_group(config.device, 0, world, port, pp)
            self.driver = model_runner(config, loaded)
        except BaseException:
            self.shutdown()
            raise

    @property
    def _procs(self) -> list[Any]:
        return self._ranks.procs

    # ---- life cycle (the runner's interface: shoal/executor/driver.py) -------------------
    def shutdown(self) -> None:
        """Stops the workers and leaves the process group (idempotent)."""
        self._finalizer()

    def _driver_failed(self, exc: BaseException) -> None:
        self._raise_if_dead(exc)  # a peer that died mid-step fails rank 0's send/recv

    def _raise_if_dead(self, cause: BaseException | None = None) -> None:
        dead = [p.name for p in self._procs if not p.is_alive()]
        if not dead and cause is not None:  # the collective may fail before the exit shows
            multiprocessing.connection.wait([p.sentinel for p in self._procs], timeout=1.0)
            dead = [p.name for p in self._procs if not p.is_alive()]
        if dead:
            raise WorkerDiedError(f"tensor-parallel worker(s) {', '.join(dead)} exited") from cause

    def _broadcast(self, cmd: Any) -> None:
        self._raise_if_dead()
        data = self._encoder.encode(cmd)
        for sock in self._ranks.sockets:
            # a PUSH to a worker that died (SIGKILL, OOM) before its exit shows would block
            # for ever: each wait past SEND_TIMEOUT_MS checks the workers again
            while True:
                try:
                    sock.send(data, copy=False, flags=zmq.NOBLOCK)
                    break
                except zmq.Again:
                    if sock.poll(SEND_TIMEOUT_MS, zmq.POLLOUT):
                        continue
                    self._raise_if_dead(TimeoutError("a worker took no command for "
                                                     f"{SEND_TIMEOUT_MS} ms"))
