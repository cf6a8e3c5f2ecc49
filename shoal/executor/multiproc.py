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
so stage 0 runs micro-batch N+1 while the later stages run N (shoal/executor/driver.py)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import shutil
import tempfile
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq

from shoal.config import EngineConfig
from shoal.distributed.parallel_state import reset_tensor_parallel
from shoal.executor.commands import (
    Stop,
)
from shoal.executor.distributed_init import free_port, join_tensor_parallel_group
from shoal.executor.driver import DriverExecutor
from shoal.executor.worker import run_worker
from shoal.loader import LoadedModel


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process is gone: no step can run any more."""


class MultiprocExecutor(DriverExecutor):
    def __init__(self, config: EngineConfig, loaded: LoadedModel):
        from shoal.spec_decode.factory import build_drafter
        from shoal.worker.model_runner import ModelRunner

        pc = config.parallel_config
        pp = pc.pipeline_parallel_size
        world = pc.tensor_parallel_size * pp
        self.world = world
        threads = None
        if config.device.type == "cpu":  # the ranks share this process's cores
            threads = max(1, torch.get_num_threads() // world)
            torch.set_num_threads(threads)
        self._ipc_dir = tempfile.mkdtemp(prefix="shoal-tp-")
        self._ctx = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        self._procs: list[Any] = []
        self._encoder = msgspec.msgpack.Encoder()
        port = free_port()
        mp = multiprocessing.get_context("spawn")
        try:
            for rank in range(1, world):
                addr = f"ipc://{self._ipc_dir}/rank{rank}"
                sock = self._ctx.socket(zmq.PUSH)
                sock.bind(addr)
                self._sockets.append(sock)
                proc = mp.Process(target=run_worker, name=f"shoal-tp-rank{rank}", daemon=True,
                                  args=(config, rank, world, port, addr, threads, pp))
                proc.start()
                self._procs.append(proc)
            join_tensor_parallel_group(config.device, 0, world, port, pp)
            self.driver = ModelRunner(config, loaded, build_drafter)
        except BaseException:
            self.shutdown()
            raise

    # ---- life cycle (the runner's interface: shoal/executor/driver.py) -------------------
    def shutdown(self) -> None:
        """Stops the workers and leaves the process group (idempotent)."""
        for sock, proc in zip(self._sockets, self._procs):
            if proc.is_alive():
                try:
                    sock.send(self._encoder.encode(Stop()), zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        for proc in self._procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for sock in self._sockets:
            sock.close(linger=0)
        self._sockets, self._procs = [], []
        if not self._ctx.closed:
            self._ctx.term()
        if dist.is_initialized():
            dist.destroy_process_group()
        reset_tensor_parallel()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

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
        for sock in self._sockets:
            sock.send(data, copy=False)

    def __del__(self) -> None:  # an engine dropped without shutdown(): no orphan workers
        if self.__dict__.get("_procs"):
            try:
                self.shutdown()
            except Exception:
                pass

