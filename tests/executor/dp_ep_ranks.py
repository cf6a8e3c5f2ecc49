"""Rank functions of tests/executor/test_dp_expert_parallel.py, in a module of their own so
the spawned ranks import little more than torch."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

# (tokens of rank 0, tokens of rank 1, experts routed to): 4 experts, 2 per rank.
A2A_CASES = [
    (5, 3, 4),  # both ways, uneven
    (4, 0, 2),  # rank 1: no token of its own, and none routed to its experts
    (0, 3, 2),  # rank 0: no token of its own, receives all; rank 1 receives nothing
]


def all_to_all_rank(rank: int, world: int, port: int) -> None:
    from shoal.distributed.parallel_state import (
        expert_parallel,
        init_dp_expert_parallel,
        reset_dp_expert_parallel,
    )
    from shoal.layers.moe.all_to_all import all_to_all_experts
    from shoal.layers.moe.layer import FusedMoE, fused_experts
    from shoal.layers.moe.torch_experts import experts_torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    e, h, i, k = 4, 16, 8, 2
    epr = e // world
    gen = torch.Generator().manual_seed(0)  # the same weights on every rank
    w1, w3, w2 = (torch.randn(e, i, h, generator=gen), torch.randn(e, i, h, generator=gen),
                  torch.randn(e, h, i, generator=gen))
    w13 = torch.cat([w1, w3], dim=1)
    init_dp_expert_parallel(dist.group.WORLD)
    try:
        with expert_parallel(True):  # the layer: its experts, tokens dispatched
            moe = FusedMoE(e, h, i)
        assert moe.w13_weight.shape == (epr, 2 * i, h) and moe.dispatch_group is not None
        for n in range(e):
            moe.weight_loader(moe.w13_weight, w1[n], n, "w1")
            moe.weight_loader(moe.w13_weight, w3[n], n, "w3")
            moe.weight_loader(moe.w2_weight, w2[n], n, "w2")
        for case, (*tokens, routed) in enumerate(A2A_CASES):
            torch.manual_seed(10 * case + rank)  # each rank's own tokens and routing
            t = tokens[rank]
            x = torch.randn(t, h)
            ids = torch.stack([torch.randperm(routed)[:k] for _ in range(t)]) if t else (
                torch.empty(0, k, dtype=torch.long))
            weights = torch.rand(t, k)
            expected = experts_torch(x, w13, w2, weights, ids)  # every expert, one rank
            received: list[int] = []

            def run_local(xs: torch.Tensor, local: torch.Tensor,
                          received: list[int] = received) -> torch.Tensor:
                received.append(xs.shape[0])
                lo = rank * epr
                return fused_experts(xs, w13[lo:lo + epr], w2[lo:lo + epr],
                                     torch.ones(xs.shape[0], 1), local[:, None],
                                     use_triton_ops=False)

            got = all_to_all_experts(x, weights, ids, epr, run_local, dist.group.WORLD)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
            if routed <= epr and rank == 1:
                assert received == []  # nothing for its experts: it only joined the exchange
            torch.testing.assert_close(moe(x, weights, ids), expected, atol=1e-4, rtol=1e-4)
    finally:
        reset_dp_expert_parallel()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip gloo's C++ teardown (see tests/gloo_harness.py)
