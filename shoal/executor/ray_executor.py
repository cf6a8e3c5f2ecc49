"""Tensor and pipeline parallelism over Ray actors, on this host or several (vLLM's `ray`
executor).

The same shape as MultiprocExecutor (shoal/executor/multiproc.py): rank 0 is a ModelRunner in
the engine core's own process (the driver); ranks 1..N-1 (N = tp * pp) are Ray actors
(RayWorker below), placed with a placement group of one bundle per rank ({"CPU": 1} on the
CPU, {"GPU": 1} on CUDA; bundle 0 is pinned to the driver's node and held for rank 0). All
ranks join one torch.distributed group (gloo on the CPU, NCCL on GPUs) at the driver's node IP.
Every step the driver sends the msgpack-encoded command (the same commands as mp) to each
actor as an actor method call, then runs it itself; an actor runs them with the mp worker's
own code (RankCommands in shoal/executor/worker.py), in order (Ray runs one caller's calls to
an actor in the order they were made). The collectives inside the model keep the ranks in
lockstep and only rank 0's sampled tokens are returned. Pipeline parallelism works as on mp:
rank r is stage r // tp, and up to pp micro-batches are in flight (FinishStep).

The driver's shoal environment variables (those of shoal/envs.py: SHOAL_PP_LAYER_PARTITION,
...) are set in each actor before it builds its model: a Ray worker on another node does not
inherit them.

Ray is optional: this module imports it only when an executor is built."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from shoal import envs
from shoal.config import EngineConfig, require_ray
from shoal.distributed.parallel_state import reset_tensor_parallel
from shoal.executor.commands import Command
from shoal.executor.distributed_init import join_tensor_parallel_group
from shoal.executor.driver import DriverExecutor
from shoal.executor.multiproc import WorkerDiedError
from shoal.executor.rank_runner import load_rank_model, model_runner
from shoal.executor.worker import RankCommands
from shoal.loader import LoadedModel

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120  # resources the cluster does not have: fail instead of waiting
STARTUP_TIMEOUT_S = 600  # the actors' model load
FAULT_WAIT_S = 5.0  # after a failed step, how long to wait for the actors' calls to settle


def _import_ray() -> Any:
    require_ray()
    try:
        import ray
    except ImportError as e:  # find_spec saw it, but it does not import
        raise ValueError(f"distributed_executor_backend 'ray' could not import ray: {e}") from e
    return ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RayWorker:
    """One worker rank, as a Ray actor (wrapped with ray.remote by the executor)."""

    def __init__(self) -> None:
        self.commands: RankCommands | None = None
        self.decoder = msgspec.msgpack.Decoder(Command)

    def gpu_ids(self) -> list[int]:
        import ray

        return [int(i) for i in ray.get_gpu_ids()]

    def setup(self, config: EngineConfig, rank: int, world: int, host: str, port: int,
              cpu_threads: int | None, env: dict[str, str]) -> tuple[int, str]:
        os.environ.update(env)
        if cpu_threads is not None:
            torch.set_num_threads(cpu_threads)
        if config.device.type == "cuda":  # Ray set CUDA_VISIBLE_DEVICES to this bundle's GPU
            config = dataclasses.replace(config, device=torch.device("cuda", 0))
        join_tensor_parallel_group(config.device, rank, world, port,
                                   config.parallel_config.pipeline_parallel_size, host)
        torch.manual_seed(config.model_config.seed)
        loaded = load_rank_model(config)
        self.commands = RankCommands(model_runner(config, loaded))
        import ray

        return os.getpid(), ray.util.get_node_ip_address()

    def run(self, data: bytes) -> None:
        assert self.commands is not None
        self.commands.run(self.decoder.decode(data))


class _Rank0Holder:
    """Holds bundle 0 (the driver's GPU) so Ray gives that GPU to no worker rank."""

    def gpu_ids(self) -> list[int]:
        import ray

        return [int(i) for i in ray.get_gpu_ids()]


class RayExecutor(DriverExecutor):
    def __init__(self, config: EngineConfig, loaded: LoadedModel):
        ray = _import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pc = config.parallel_config
        world = pc.world_size  # tp * pp: rank r is pipeline stage r // tp
        self.world = world
        self._actors: list[Any] = []
        self._pids: list[int] = []
        self._pending: dict[Any, int] = {}  # ref of an actor call not yet seen done -> rank
        self._last: dict[int, Any] = {}  # rank -> ref of its latest call
        self._pg = None
        self._holder = None
        self._encoder = msgspec.msgpack.Encoder()
        self._owns_ray = False
        self._ray = ray
        on_gpu = config.device.type == "cuda"
        threads = None
        if not on_gpu:  # one core per bundle; the driver's rank shares this process's cores
            threads = max(1, torch.get_num_threads() // world)
            torch.set_num_threads(threads)
        try:
            self._init_ray(world, on_gpu)
            host = ray.util.get_node_ip_address()
            resource = "GPU" if on_gpu else "CPU"
            bundles = [{resource: 1.0} for _ in range(world)]
            bundles[0][f"node:{host}"] = 0.001  # rank 0 runs here, in the driver
            fits = any(n.get("Alive") and n.get("Resources", {}).get(resource, 0) >= world
                       for n in ray.nodes())
            self._pg = placement_group(bundles, strategy="STRICT_PACK" if fits else "PACK",
                                       name=f"shoal-tp-{os.getpid()}")
            try:
                ray.get(self._pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
            except ray.exceptions.GetTimeoutError:
                raise ValueError(
                    f"Ray could not place {world} ranks ({world} x {{{resource!r}: 1}}) within "
                    f"{PLACEMENT_TIMEOUT_S} s; cluster resources: "
                    f"{ray.cluster_resources()}") from None

            def strategy(rank: int) -> Any:
                return PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank)

            if on_gpu:
                holder_cls = ray.remote(num_cpus=0, num_gpus=1)(_Rank0Holder)
                self._holder = holder_cls.options(scheduling_strategy=strategy(0)).remote()
                config = dataclasses.replace(
                    config, device=_driver_device(ray.get(self._holder.gpu_ids.remote())))
            worker_cls = ray.remote(RayWorker)
            opts = {"num_cpus": 0, "num_gpus": 1} if on_gpu else {"num_cpus": 1}
            port = _free_port()
            env = envs.set_variables()  # vLLM forwards its VLLM_* variables the same way
            setups = []
            for rank in range(1, world):
                actor = worker_cls.options(name=f"shoal-tp-rank{rank}-{os.getpid()}",
                                           scheduling_strategy=strategy(rank), **opts).remote()
                self._actors.append(actor)
                setups.append(actor.setup.remote(config, rank, world, host, port, threads, env))
            join_tensor_parallel_group(config.device, 0, world, port,
                                       pc.pipeline_parallel_size, host)
            self.driver = model_runner(config, loaded)
            # Processes on this node, waited for at shutdown (ray.kill does not wait).
            self._pids = [pid for pid, ip in ray.get(setups, timeout=STARTUP_TIMEOUT_S)
                          if ip == host]
        except BaseException:
            self.shutdown()
            raise

    def _init_ray(self, world: int, on_gpu: bool) -> None:
        ray = self._ray
        if ray.is_initialized():
            return
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address="auto")
            return
        try:  # a cluster `ray start` began on this node (the head node)
            ray.init(address="auto")
            return
        except ConnectionError:
            pass
        # A local cluster of our own, stopped at shutdown.
        cpus = None if on_gpu else max(os.cpu_count() or 1, world)
        ray.init(num_cpus=cpus, include_dashboard=False)
        self._owns_ray = True

    # ---- life cycle (the runner's interface: shoal/executor/driver.py) -------------------
    def shutdown(self) -> None:
        """Kills the actors, removes the placement group, leaves the process group, and stops
        the local Ray cluster if this executor started it (idempotent)."""
        ray = self.__dict__.get("_ray")
        if ray is None:
            return
        for actor in [*self.__dict__.get("_actors", []), self.__dict__.get("_holder")]:
            if actor is not None:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:
                    pass
        self._actors, self._holder, self._pending, self._last = [], None, {}, {}
        if self.__dict__.get("_pg") is not None:
            try:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._pg)
            except Exception:
                pass
            self._pg = None
        if dist.is_initialized():
            dist.destroy_process_group()
        reset_tensor_parallel()
        _wait_exited(self.__dict__.get("_pids", []), 10.0)
        self._pids = []
        if self.__dict__.get("_owns_ray") and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False

    # ---- helpers ----------------------------------------------------------------------------
    def _before_reset(self) -> None:
        # A step failed. If it was a worker rank dying (the driver's collective then fails
        # too), its call fails within moments: that is the error to raise.
        self._check_actors(wait_s=FAULT_WAIT_S)

    def _broadcast(self, cmd: Any) -> None:
        self._check_actors(wait_s=0.0)
        data = self._encoder.encode(cmd)
        for rank, actor in enumerate(self._actors, start=1):
            ref = actor.run.remote(data)
            self._pending[ref] = rank
            self._last[rank] = ref

    def _check_actors(self, wait_s: float) -> None:
        """Raises WorkerDiedError if an actor call failed (the actor died, or its rank raised:
        the ranks are out of lockstep either way). Waits up to wait_s for each rank's latest
        call to settle."""
        ray = self._ray
        if wait_s > 0 and self._last:
            deadline = time.monotonic() + wait_s
            waiting = list(self._last.values())
            while waiting and time.monotonic() < deadline:
                ready, waiting = ray.wait(waiting, num_returns=1,
                                          timeout=max(0.0, deadline - time.monotonic()))
                if ready:
                    self._settle(ready)
        if self._pending:
            ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
            self._settle(ready)

    def _settle(self, refs: list[Any]) -> None:
        ray = self._ray
        for ref in refs:
            rank = self._pending.pop(ref, None)
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
                raise WorkerDiedError(f"tensor-parallel worker (Ray actor) shoal-tp-rank{rank} "
                                      f"failed: {type(e).__name__}: {e}") from e

    def __del__(self) -> None:  # an engine dropped without shutdown(): no orphan actors
        if self.__dict__.get("_actors") or self.__dict__.get("_pg") is not None:
            try:
                self.shutdown()
            except Exception:
                pass


def _driver_device(gpu_ids: list[int]) -> torch.device:
    """The CUDA device of the GPU Ray reserved for rank 0 (Ray's ids are physical; this
    process's CUDA_VISIBLE_DEVICES, if set, renumbers them)."""
    gpu = gpu_ids[0]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        ids = [v.strip() for v in visible.split(",")]
        if str(gpu) not in ids:
            raise ValueError(f"Ray reserved GPU {gpu} for rank 0, which this process does not "
                             f"see (CUDA_VISIBLE_DEVICES={visible})")
        return torch.device("cuda", ids.index(str(gpu)))
    return torch.device("cuda", gpu)


def _wait_exited(pids: list[int], timeout: float) -> None:
    """ray.kill is asynchronous: wait for the actors' processes on this node to go."""
    deadline = time.monotonic() + timeout
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                with open(f"/proc/{pid}/status") as f:
                    if any(line.startswith("State:") and "Z" in line for line in f):
                        break
            except (FileNotFoundError, ProcessLookupError):
                break
            time.sleep(0.05)
