"""DP+EP: data-parallel replicas that share their MoE experts step in lockstep.

With data_parallel_size > 1 and enable_expert_parallel, each replica keeps its own scheduler,
KV cache and batch (data-parallel attention), but the experts of every MoE layer are split
over the replicas and tokens travel all-to-all between them (shoal/layers/moe/all_to_all.py).
Every MoE forward is thus a collective over all replicas: when one runs a step, all must run
one. Each step therefore starts with one all-reduce over a CPU (gloo) group of the replicas'
engine cores: how many replicas have work. None: nobody steps. Some: every replica steps, and
one with no work of its own (or whose schedule came up empty) runs a dummy forward pass of one
made-up token (`ModelRunner.run_dummy_batch`, vLLM's dummy batch), sampling nothing. A
drafter whose MoE layers split their experts too (speculative decoding) runs as many passes
as the others: one more round, max, on its first pass (shoal/worker/draft_lockstep.py).
With LoRA on the MoE experts, every forward pass (a dummy one too) starts with one more
round, max: whether some replica's step adapters changed, and so whether the replicas must
exchange them to keep their shared expert slots alike (shoal/lora/shared_expert_slots.py).
That bid cannot ride on the round at the start of a step, which comes before the scheduler
picks the step's requests.

Serving, an idle engine core still takes part in one round every IDLE_SYNC_MS (a heartbeat:
a request that reaches any replica starts the next step on all of them within that time);
forward passes stop as soon as every replica is idle. Offline, each replica is a process of
its own with an LLM(data_parallel_rank=r, data_parallel_master_port=p): every rank must call
generate() as often as the others (a rank with no prompts passes an empty list); each call
returns once every replica is idle.

The process group: world = data_parallel_size, one rank per engine core, joined over TCP at
127.0.0.1:data_parallel_master_port (chosen by the parent), on the device's backend (NCCL on
GPUs, gloo on the CPU): the EP group. Two gloo groups of the same replicas carry the rounds:
the heartbeat group (the round at the start of a step) with a timeout of
SHOAL_DP_SYNC_TIMEOUT_S (shoal/envs.py), and the mid-step group (the LoRA bid, a drafter's
pass count) with the EP group's COLLECTIVE_TIMEOUT; every replica creates them in that order.
Joining, the replicas check that their LoRA settings agree (the MoE experts' adapter slots
are one table over the replicas: shoal/lora/shared_expert_slots.py).

Faults: a replica that dies breaks every collective. A gloo peer's death fails the others'
next collective at once (connection closed); a replica that hangs fails them after the
timeout of the round it waits in. The heartbeat's is short (SHOAL_DP_SYNC_TIMEOUT_S): replicas
reach the start of a step within a step's non-collective tail of each other. A mid-step round
waits the long COLLECTIVE_TIMEOUT instead: before it a replica may do long local work that an
idle replica's dummy pass skips (reading a large adapter from disk for the step, a vision
encoder, KV connector loads), so the idle one bids at once and must wait as long as a forward
pass's all-to-all would. Either way the engine core then raises DPPeerLostError out of its
step and exits; the frontend sees an engine die, fails every request in flight and /health
answers 503. Unlike plain data parallelism, whose replicas share nothing, DP+EP cannot keep
serving with one replica dead: the others' experts are gone. (On GPUs a peer that dies
inside an NCCL all-to-all is noticed by the NCCL timeout of the EP group, COLLECTIVE_TIMEOUT;
the server's frontend does not wait for it: it fails the requests and stops the engines as
soon as one engine process is gone.)"""

from __future__ import annotations

import datetime
import logging
import os
from typing import TYPE_CHECKING, Any

from shoal import envs

if TYPE_CHECKING:
    from shoal.config import EngineConfig

logger = logging.getLogger(__name__)

IDLE_SYNC_MS = 10  # heartbeat of an idle serving engine core


class DPPeerLostError(RuntimeError):
    """A collective among the DP+EP replicas failed: a replica died or hung."""


class DPLockstep:
    """The per-step agreement of one replica with the others (see the module docstring)."""

    idle_poll_ms = IDLE_SYNC_MS

    def __init__(self, heartbeat_group: Any, mid_step_group: Any, rank: int, size: int):
        import torch

        # (gloo groups of the replicas: the start-of-step round's with the short timeout,
        # agree_max's with the long one; see the module docstring's Faults)
        self.heartbeat_group, self.mid_step_group = heartbeat_group, mid_step_group
        self.rank, self.size = rank, size
        self.group_busy = False  # some replica had work at the last round
        self.dummy_steps = 0  # forward passes run for the others' sake
        self._flag = torch.zeros(1, dtype=torch.int64)
        self._started = False
        self._forwards_before = 0

    def sync(self, busy: bool) -> bool:
        """One round: whether any replica has work (then every replica steps)."""
        import torch.distributed as dist

        try:
            if not self._started:  # the replicas finish starting up at different times
                dist.barrier()  # the world group: the long start-up timeout
                self._started = True
            self._flag.fill_(int(busy))
            dist.all_reduce(self._flag, group=self.heartbeat_group)
        except RuntimeError as e:
            raise DPPeerLostError(f"DP+EP replica {self.rank}: another replica is gone or "
                                  f"stuck ({e})") from e
        self.group_busy = bool(self._flag.item())
        return self.group_busy

    def begin_step(self, busy: bool, runner: Any) -> bool:
        """Before a step: False when every replica is idle (nobody runs a forward pass)."""
        if not self.sync(busy):
            return False
        self._forwards_before = runner.num_forwards
        return True

    def end_step(self, runner: Any) -> None:
        """After a step: a replica whose step ran no forward pass runs the dummy one; then a
        drafter with experts split over the replicas, its dummy passes up to the count the
        replicas agreed on (worker/draft_lockstep.py: a replica without a forward pass bids
        here)."""
        if runner.num_forwards == self._forwards_before:
            runner.run_dummy_batch()
            self.dummy_steps += 1
        runner.pad_draft_passes()

    def agree_max(self, value: int) -> int:
        """One round mid-step: the largest `value` of any replica (each calls it at the same
        points of the step: whether its expert LoRA adapters changed, before the forward pass,
        lora/shared_expert_slots.py; a drafter's pass count, worker/draft_lockstep.py). On the
        mid-step group: a replica may read adapters from disk just before it."""
        import torch.distributed as dist

        try:
            self._flag.fill_(value)
            dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.mid_step_group)
        except RuntimeError as e:
            raise DPPeerLostError(f"DP+EP replica {self.rank}: another replica is gone or "
                                  f"stuck ({e})") from e
        return int(self._flag.item())

    def rejoin(self) -> None:
        """Offline: take part in at least one more round (the start of a generate call)."""
        self.group_busy = True

    def shutdown(self) -> None:
        import torch.distributed as dist

        from shoal.distributed.parallel_state import reset_dp_expert_parallel

        reset_dp_expert_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()


def join_dp_lockstep(config: EngineConfig) -> DPLockstep | None:
    """DP+EP: joins the replicas' process group, makes it the expert-parallel group (before
    the model is built: FusedMoE reads it) and returns this replica's lockstep; None
    otherwise."""
    pc = config.parallel_config
    if not pc.dp_expert_parallel:
        return None
    import torch
    import torch.distributed as dist

    from shoal.distributed.parallel_state import init_dp_expert_parallel
    from shoal.executor.distributed_init import COLLECTIVE_TIMEOUT

    device = config.device
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rank, size = pc.data_parallel_rank, pc.data_parallel_size
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            init_method=f"tcp://127.0.0.1:{pc.data_parallel_master_port}",
                            rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT)
    # Longest a replica waits for the others at the start of a step. Replicas arrive there
    # within the non-collective tail of a step of each other (sampling, output handling).
    sync_timeout = datetime.timedelta(seconds=envs.SHOAL_DP_SYNC_TIMEOUT_S.get())
    heartbeat = dist.new_group(backend="gloo", timeout=sync_timeout)
    # Mid-step rounds: as long as the EP group's all-to-all would wait (module docstring).
    mid_step = dist.new_group(backend="gloo", timeout=COLLECTIVE_TIMEOUT)
    init_dp_expert_parallel(dist.group.WORLD)
    _check_same_lora_settings(config, size)
    logger.info("DP+EP: replica %d of %d (pid %d) joined the expert-parallel group", rank,
                size, os.getpid())
    return DPLockstep(heartbeat, mid_step, rank, size)


def _check_same_lora_settings(config: EngineConfig, size: int) -> None:
    """The replicas number the MoE experts' adapter slots alike (shoal/lora/
    shared_expert_slots.py): their LoRA settings must agree. ValueError on every replica
    (the group left) when they do not."""
    import torch.distributed as dist

    from shoal.distributed.parallel_state import reset_dp_expert_parallel
    from shoal.lora.shared_expert_slots import check_same_lora_settings, lora_settings

    settings: list[Any] = [None] * size
    dist.all_gather_object(settings, lora_settings(config.lora_config))
    try:
        check_same_lora_settings(settings)
    except ValueError:
        reset_dp_expert_parallel()
        dist.destroy_process_group()
        raise
