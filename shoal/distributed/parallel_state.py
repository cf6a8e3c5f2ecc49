"""Tensor-parallel group state. World size 1 needs no process group at all."""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None


def init_tensor_parallel(group: dist.ProcessGroup | None = None) -> None:
    """Use `group` (default: the world group) for tensor parallelism."""
    global _TP_GROUP
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before tensor parallelism")
    _TP_GROUP = group if group is not None else dist.group.WORLD


def reset_tensor_parallel() -> None:
    global _TP_GROUP
    _TP_GROUP = None


def get_tp_world_size() -> int:
    return 1 if _TP_GROUP is None else dist.get_world_size(_TP_GROUP)


def get_tp_rank() -> int:
    return 0 if _TP_GROUP is None else dist.get_rank(_TP_GROUP)


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if get_tp_world_size() == 1:
        return x
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tp_all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    world = get_tp_world_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=-1)


def tp_min_int(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value` (ranks agree on one KV pool size)."""
    if get_tp_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_TP_GROUP)
    return int(t.item())
