"""Joining the tensor/pipeline-parallel process group, the same way on every rank."""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from shoal.distributed.parallel_state import init_model_parallel

# A rank that waits longer than this in a collective gives up (a peer died mid-step).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_tensor_parallel_group(device: torch.device, rank: int, world: int, port: int,
                               pp: int = 1, host: str = "127.0.0.1") -> None:
    """NCCL between GPUs (each rank on its own device), gloo on the CPU. world = tp * pp:
    rank r is pipeline stage r // tp (shoal/distributed/parallel_state.py). host: rank 0's
    address (loopback for mp; the driver's node IP for Ray actors, maybe on other nodes)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":  # a bare "cuda" is the current device (rank 0 of mp)
        torch.cuda.set_device(device if device.index is not None else torch.cuda.current_device())
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank,
                            world_size=world, timeout=COLLECTIVE_TIMEOUT)
    init_model_parallel(world // pp, pp)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r uses GPU r (the engine's device index is the first one)."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)
