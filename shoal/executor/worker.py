"""A tensor/pipeline-parallel worker rank: its own ModelRunner over its shard of the weights
(its TP slice of its pipeline stage's layers), running every command the driver (rank 0)
sends, in order. Its sampled tokens are never read: the scheduler sends every input token
(with tensor parallelism it runs synchronously; with pipeline micro-batches no request is in
two steps at once), so what rank 0 sampled is what each rank runs next.

With pipeline parallelism a step is finished when the driver says so (FinishStep), not right
after its launch: the driver launches the next micro-batch first, and stage 0's other TP
ranks must run their collectives (the logits' gather) in the driver's order.

RankCommands is that loop's body, for the mp worker process here and the Ray actor alike
(shoal/executor/ray_executor.py)."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import deque
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq

from shoal.config import EngineConfig
from shoal.executor.commands import (
    AddLoRA,
    CheckHealth,
    CollectiveRPC,
    Command,
    FinishStep,
    InitKVCache,
    PinLoRA,
    RemoveLoRA,
    RemoveRequests,
    ResetAfterFault,
    RunStep,
    Stop,
)
from shoal.executor.distributed_init import join_tensor_parallel_group, rank_device
from shoal.executor.rank_runner import load_rank_model, model_runner
from shoal.executor.rpc import gather_rpc

logger = logging.getLogger(__name__)
PARENT_CHECK_MS = 1000  # how often an idle worker checks that the engine core still runs


def run_worker(config: EngineConfig, rank: int, world: int, port: int, command_addr: str,
               cpu_threads: int | None, pp: int = 1) -> None:
    """The worker process's main (spawned by MultiprocExecutor)."""
    parent_pid = os.getppid()
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    config = dataclasses.replace(config, device=rank_device(config.device, rank))
    ctx = zmq.Context()
    commands = ctx.socket(zmq.PULL)
    commands.connect(command_addr)
    code = 0
    try:
        join_tensor_parallel_group(config.device, rank, world, port, pp)
        torch.manual_seed(config.model_config.seed)
        loaded = load_rank_model(config)
        runner = model_runner(config, loaded)
        _serve(runner, commands, parent_pid)
    except Exception:
        logger.exception("tensor-parallel rank %d failed", rank)
        code = 1
    finally:
        commands.close(linger=0)
        ctx.term()
        if dist.is_initialized():
            dist.destroy_process_group()
    # Skip interpreter teardown: a gloo/NCCL thread winding down at exit can abort the process.
    os._exit(code)


class RankCommands:
    """One worker rank's side of the driver's commands, shared by the mp worker process
    (_serve below) and the Ray actor (shoal/executor/ray_executor.py): it runs them on its
    runner in the order they come."""

    def __init__(self, runner: Any):
        self.runner = runner
        self.launched: deque[Any] = deque()  # pipeline parallel: steps not finished yet

    def run(self, cmd: Command) -> bool:
        """Runs one command; False once told to stop."""
        runner = self.runner
        if isinstance(cmd, RunStep):
            handle = runner.execute(cmd.sched)
            if not runner.pipelined:
                self._finish(handle)
            else:
                self.launched.append(handle)
        elif isinstance(cmd, FinishStep):
            self._finish(self.launched.popleft())
        elif isinstance(cmd, RemoveRequests):
            runner.remove_requests(set(cmd.serials))
        elif isinstance(cmd, RemoveLoRA):
            runner.remove_lora(cmd.lora_id)
        elif isinstance(cmd, (AddLoRA, PinLoRA)):
            self._lora_call(cmd)
        elif isinstance(cmd, CollectiveRPC):
            gather_rpc(runner, cmd.method, cmd.args)
        elif isinstance(cmd, InitKVCache):
            runner.initialize_kv_cache()
        elif isinstance(cmd, CheckHealth):
            runner.check_health()
        elif isinstance(cmd, ResetAfterFault):
            self.launched.clear()
            runner.reset_after_fault()
        elif isinstance(cmd, Stop):
            return False
        return True

    def _lora_call(self, cmd: AddLoRA | PinLoRA) -> None:
        """What the driver did already, so it succeeds here too; if it does not (a file
        gone since), this rank serves on: a request naming the adapter reads it again."""
        try:
            if isinstance(cmd, AddLoRA):
                self.runner.add_lora(cmd.lora)
            else:
                self.runner.pin_lora(cmd.lora_id)
        except Exception:
            logger.exception("%s failed on this rank", type(cmd).__name__)

    def _finish(self, handle: Any) -> None:
        # No grammar: this rank's tokens are never read (the driver's are).
        self.runner.sample(handle, None)
        self.runner.finish(handle)


def _serve(runner, commands: zmq.Socket, parent_pid: int) -> None:  # noqa: ANN001
    decoder = msgspec.msgpack.Decoder(Command)
    rank = RankCommands(runner)
    while True:
        if not commands.poll(PARENT_CHECK_MS):
            if os.getppid() != parent_pid:  # the engine core died without stopping us
                logger.warning("the engine core process is gone; worker exits")
                return
            continue
        if not rank.run(decoder.decode(commands.recv())):
            return
