"""All-to-all token dispatch for expert parallelism across data-parallel replicas (DP+EP).

Why: under DP+EP each rank holds its own batch (data-parallel attention) and E / ep whole
experts. Replicating every token on every rank (what EP inside a TP group does) is not
possible, so each (token, expert) pair travels to the rank that owns the expert and its
output travels back:

    route locally -> counts all-to-all -> hidden states all-to-all -> local experts
                  -> outputs all-to-all (the reverse splits) -> weighted sum per token

Pairs are sent sorted by global expert id, so each rank's slice is sorted by local expert and
the per-(rank, local expert) counts say which expert every received row is for: three exchanges
in all, four with token_tags (a value per token that travels with its pairs: the token's LoRA
slot in the replicas' shared table, shoal/lora/shared_expert_slots.py). The sum at the source
adds the pairs in expert order, as experts_torch does on one rank, so fp32 results match the
single-rank layer bit for bit.

Collectives: torch.distributed.all_to_all_single with uneven split sizes, which gloo (CPU) and
NCCL (GPU) both implement. The split sizes are read on the host (one device sync per layer):
eager mode only; DP+EP runs without CUDA graphs (EngineArgs turns them off)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

# (hidden states [N, H] received, their local expert ids [N][, their tags [N]]) ->
# unweighted outputs [N, H]
LocalExperts = Callable[..., torch.Tensor]


def all_to_all_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                       experts_per_rank: int, run_local: LocalExperts,
                       group: dist.ProcessGroup | None,
                       token_tags: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] this rank's tokens; topk_ids / topk_weights [T, k] their routing (global
    expert ids; rank r owns experts [r * experts_per_rank, (r + 1) * experts_per_rank)).
    Returns [T, H]: each token's weighted sum over its k experts, wherever they ran. Every rank
    of `group` must call it (a rank with no token of its own still serves its experts), all
    with token_tags [T] (int32) or all without: run_local then gets the received rows' tags."""
    world = dist.get_world_size(group)
    t, k = topk_ids.shape
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs by expert, so by owning rank
    tokens = order // k
    # Pairs per (destination rank, its local expert), and what every source sends here.
    send_counts = torch.bincount(flat, minlength=world * experts_per_rank)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    send_splits = send_counts.view(world, experts_per_rank).sum(1).tolist()
    recv_by_expert = recv_counts.view(world, experts_per_rank)
    recv_splits = recv_by_expert.sum(1).tolist()

    send_x = x.index_select(0, tokens)
    recv_x = x.new_empty(sum(recv_splits), x.shape[1])
    dist.all_to_all_single(recv_x, send_x, recv_splits, send_splits, group=group)
    tags = ()
    if token_tags is not None:
        recv_tags = token_tags.new_empty(recv_x.shape[0])
        dist.all_to_all_single(recv_tags, token_tags.index_select(0, tokens), recv_splits,
                               send_splits, group=group)
        tags = (recv_tags,)
    if recv_x.shape[0]:
        local_ids = torch.arange(experts_per_rank, device=x.device).repeat(world)
        recv_ids = torch.repeat_interleave(local_ids, recv_by_expert.reshape(-1))
        y = run_local(recv_x, recv_ids, *tags)
    else:  # no pair for this rank's experts this time: it still takes part in the exchange
        y = recv_x
    back = torch.empty_like(send_x)
    dist.all_to_all_single(back, y.contiguous(), send_splits, recv_splits, group=group)

    out = torch.zeros_like(x)
    out.index_add_(0, tokens, back * topk_weights.reshape(-1)[order, None])
    return out
