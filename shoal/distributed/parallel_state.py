"""Tensor- and pipeline-parallel group state. World size 1 needs no process group at all.

Layout (vLLM's): world = tp * pp ranks; rank r is pipeline stage r // tp and tensor-parallel
rank r % tp, so each stage's TP group is the contiguous ranks [s*tp, (s+1)*tp). Tensor
collectives run inside the stage's TP group only; stages talk point to point (send/recv on
the world group) between the ranks of the same TP rank."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None
_TP_SIZE = 1  # the stage's TP group size (set with the group)
_PP_SIZE = 1
_PP_RANK = 0
# Expert parallelism (enable_expert_parallel): FusedMoE layers built while it is on hold whole
# experts, E / ep of them per rank, instead of every expert's slice of the intermediate dim.
# Without data parallelism the EP group is the stage's TP group (EP size = TP size, tokens
# replicated). With it (DP+EP, shoal/engine/dp_lockstep.py) the EP group spans the data-parallel
# replicas, each with tokens of its own: the MoE layers then dispatch tokens all-to-all.
_EXPERT_PARALLEL = False
_DP_EP_GROUP: dist.ProcessGroup | None = None


def init_tensor_parallel(group: dist.ProcessGroup | None = None) -> None:
    """Use `group` (default: the world group) for tensor parallelism; one pipeline stage."""
    global _TP_GROUP, _TP_SIZE, _PP_SIZE, _PP_RANK
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before tensor parallelism")
    _TP_GROUP = group if group is not None else dist.group.WORLD
    _TP_SIZE = dist.get_world_size(_TP_GROUP)
    _PP_SIZE, _PP_RANK = 1, 0


def init_model_parallel(tp: int, pp: int) -> None:
    """tp ranks per stage, pp stages (world = tp * pp). Every rank must call it (new_group is
    collective over the world, for every group, member or not)."""
    global _TP_GROUP, _TP_SIZE, _PP_SIZE, _PP_RANK
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialized before model parallelism")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != tp * pp:
        raise ValueError(f"world size {world} != tensor_parallel_size {tp} x "
                         f"pipeline_parallel_size {pp}")
    if pp == 1:
        init_tensor_parallel()
        return
    stage = rank // tp
    group = None
    if tp > 1:
        for s in range(pp):  # same order on every rank
            g = dist.new_group(list(range(s * tp, (s + 1) * tp)))
            if s == stage:
                group = g
    _TP_GROUP, _TP_SIZE = group, tp
    _PP_SIZE, _PP_RANK = pp, stage


def reset_tensor_parallel() -> None:
    global _TP_GROUP, _TP_SIZE, _PP_SIZE, _PP_RANK
    _TP_GROUP, _TP_SIZE, _PP_SIZE, _PP_RANK = None, 1, 1, 0


def get_tp_world_size() -> int:
    return 1 if _TP_GROUP is None else _TP_SIZE


def get_tp_rank() -> int:
    return 0 if _TP_GROUP is None else dist.get_rank(_TP_GROUP)


# ---- expert parallelism ------------------------------------------------------------------------
@contextmanager
def expert_parallel(enabled: bool) -> Iterator[None]:
    """Model construction inside this block shards MoE experts over the TP ranks when
    `enabled` (FusedMoE reads it once, in its constructor)."""
    global _EXPERT_PARALLEL
    prev, _EXPERT_PARALLEL = _EXPERT_PARALLEL, bool(enabled)
    try:
        yield
    finally:
        _EXPERT_PARALLEL = prev


@contextmanager
def one_pipeline_stage() -> Iterator[None]:
    """A model built inside this block is whole (one pipeline stage) whatever this rank's
    stage: models read their stage at construction and weight loading only (a draft model
    on stage 0 of a pipelined target)."""
    global _PP_SIZE, _PP_RANK
    saved = _PP_SIZE, _PP_RANK
    _PP_SIZE, _PP_RANK = 1, 0
    try:
        yield
    finally:
        _PP_SIZE, _PP_RANK = saved


def expert_parallel_enabled() -> bool:
    return _EXPERT_PARALLEL


def get_ep_world_size() -> int:
    """Ranks the experts are split over, with expert parallelism on: the data-parallel
    replicas under DP+EP, else the TP size. 1 with it off."""
    if not _EXPERT_PARALLEL:
        return 1
    if _DP_EP_GROUP is not None:
        return dist.get_world_size(_DP_EP_GROUP)
    return get_tp_world_size()


def get_ep_rank() -> int:
    if not _EXPERT_PARALLEL:
        return 0
    if _DP_EP_GROUP is not None:
        return dist.get_rank(_DP_EP_GROUP)
    return get_tp_rank()


def init_dp_expert_parallel(group: dist.ProcessGroup) -> None:
    """DP+EP: `group` (one rank per data-parallel replica) is the expert-parallel group; its
    ranks hold different tokens, so MoE layers built with expert parallelism on exchange them
    all-to-all (shoal/layers/moe/all_to_all.py)."""
    global _DP_EP_GROUP
    _DP_EP_GROUP = group


def reset_dp_expert_parallel() -> None:
    global _DP_EP_GROUP
    _DP_EP_GROUP = None


def ep_dispatch_group() -> dist.ProcessGroup | None:
    """The group MoE layers dispatch tokens over (all-to-all), or None when every EP rank
    holds the same tokens (EP inside TP) or expert parallelism is off."""
    if not _EXPERT_PARALLEL or _DP_EP_GROUP is None:
        return None
    return _DP_EP_GROUP if dist.get_world_size(_DP_EP_GROUP) > 1 else None


# ---- pipeline parallelism ---------------------------------------------------------------------
def get_pp_world_size() -> int:
    return _PP_SIZE


def pp_is_first() -> bool:
    return _PP_RANK == 0


def pp_is_last() -> bool:
    return _PP_RANK == _PP_SIZE - 1


def pp_stage_rank(stage: int) -> int:
    """The global rank of `stage`'s rank with this rank's TP rank."""
    return stage * get_tp_world_size() + get_tp_rank()


def pp_prev_rank() -> int:
    return pp_stage_rank(_PP_RANK - 1)


def pp_next_rank() -> int:
    return pp_stage_rank(_PP_RANK + 1)


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the decoder layers on stage pp_rank: contiguous, as even as possible.
    As vLLM splits them, the remainder goes one layer each to the stages just before the
    last one (the last stage also runs the final norm): 5 layers over 2 stages are 3 + 2."""
    base, rem = divmod(num_layers, pp_size)
    sizes = [base + (1 if pp_size - 1 - rem <= s < pp_size - 1 else 0)
             for s in range(pp_size)]
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


def pp_layer_partition(num_layers: int, pp_size: int) -> list[int] | None:
    """The decoder layers per stage that SHOAL_PP_LAYER_PARTITION sets (vLLM's
    VLLM_PP_LAYER_PARTITION), e.g. "13,17": stage 0 also embeds, samples and runs the engine,
    so giving it fewer layers balances the stages. None when unset or with one stage (an even
    split, get_pp_indices). A bad value is a ValueError naming the variable and the rule."""
    from shoal import envs

    var = envs.SHOAL_PP_LAYER_PARTITION
    value = var.get()
    if value is None or pp_size == 1:
        return None
    try:
        sizes = [int(part) for part in value.split(",")]
    except ValueError:
        sizes = []
    if len(sizes) != pp_size or min(sizes) < 1 or sum(sizes) != num_layers:
        raise ValueError(
            f"{var.name}={value!r} is invalid: it must be {pp_size} "
            f"comma-separated integers, one layer count per pipeline stage, each >= 1, that "
            f"sum to the model's {num_layers} decoder layers (num_hidden_layers)")
    return sizes


def pp_layer_range(num_layers: int, stage: int | None = None) -> tuple[int, int]:
    """This rank's decoder layers, or `stage`'s (all of them without pipeline parallelism):
    as SHOAL_PP_LAYER_PARTITION splits them if set (pp_layer_partition), else evenly."""
    stage = _PP_RANK if stage is None else stage
    sizes = pp_layer_partition(num_layers, _PP_SIZE)
    if sizes is None:
        return get_pp_indices(num_layers, stage, _PP_SIZE)
    start = sum(sizes[:stage])
    return start, start + sizes[stage]


# ---- collectives --------------------------------------------------------------------------------
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


def tp_gather_to_first(x: torch.Tensor) -> list[torch.Tensor] | None:
    """Every TP rank's x (the same shape on each) on TP rank 0, in rank order; None on the
    other ranks (a tensor-parallel producer's saved KV rows: shoal/kv_transfer/tp_rows.py)."""
    if get_tp_world_size() == 1:
        return [x]
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)] if get_tp_rank() == 0 else None
    dist.gather(x, parts, group=_TP_GROUP, group_dst=0)
    return parts


def tp_broadcast_from_first(x: torch.Tensor) -> torch.Tensor:
    """TP rank 0's x on every rank of the stage's TP group, in place (x on the ranks' device,
    the same shape on each). Speculation: the driver's sampled and accepted tokens become every
    rank's, whatever a rank's own sampling gave (a grammar's mask is applied on the driver
    only; unseeded sampling draws from each process's own generator)."""
    if get_tp_world_size() > 1:
        dist.broadcast(x, group=_TP_GROUP, group_src=0)
    return x


def world_min_int(value: int, device: torch.device) -> int:
    """The smallest of every rank's `value`, over all stages and TP ranks (the ranks agree on
    one KV pool size)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
