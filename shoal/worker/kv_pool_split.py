"""A pool partition per KV cache group whose layers' rows differ (DeepSeek-V4): how many
blocks each group gets from the KV memory budget.

Why partitions. In one pool of shared block ids every layer's tensor has a page for every id,
so a block of any group costs every layer's page: DeepSeek-V4's compressed entries (a CSA
entry per 4 tokens, an HCA entry per 128) saved nothing, a block of entries cost the windows'
and the open groups' pages too. Two layouts make a block cost only its group's pages:
- vLLM's hybrid allocator: one pool of equal-size pages, each group with its own tokens per
  block (a group of small rows gets proportionally more tokens a page). Its block sizes
  differ by group, so prefix hashes, slot mapping, the attention metadata and every layer's
  table reads would follow a per-group block size; V4's pages are also too unequal to unify
  (an open-groups page of one layer is 80x an HCA page at blocks of 16).
- a partition of the pool per group, every group at the one block size: the tables, hashes,
  slot mapping and layer reads stay as they are; only the ids a group allocates (its run of
  the pool, kv_cache/block_pool.py) and its tensors' length change. The price is a static
  split, chosen here: the groups that drop blocks behind a window hold a bounded number per
  request, so they get what the scheduler's limits let them hold at once (max_num_seqs
  requests' windows and one step's tokens), never more than half the budget (a smaller pool
  then runs fewer requests at a time, as any full pool does); the groups that keep the whole
  context share the rest in the ratio their tables take blocks (held_fraction: an HCA table
  holds one block in 8 at blocks of 16). That is the layout used here.

The first group (the tables every token of the context takes, which the drafters follow)
anchors the split: its blocks are the pool's num_blocks, what request validation and
num_gpu_blocks_override count, at most FIRST_BLOCKS_CAP times what the scheduler's requests
can hold at once. Used only where groups have tensors of their own
(kv_cache_tensors.partitions_pool); every other model keeps the one shared pool."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from shoal.config import EngineConfig
from shoal.core.kv_cache_spec import KVCacheGroup, KVCacheSpec
from shoal.distributed.parallel_state import world_min_int
from shoal.worker.kv_cache_sizing import kv_budget_bytes
from shoal.worker.kv_cache_tensors import bytes_per_block, partitions_pool

logger = logging.getLogger(__name__)

# The first group's blocks stop at this many times what max_num_seqs requests of
# max_model_len hold at once (the rest could only keep prefixes cached): where pages are
# small, a budget would give millions of blocks, each an object of the scheduler's pool.
FIRST_BLOCKS_CAP = 4


@dataclass(frozen=True)
class SplitLimits:
    """What bounds the blocks of the groups behind a window: the scheduler's limits."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int = 0  # (0: no cap on the first group's blocks)


def group_page_bytes(specs: Sequence[KVCacheSpec], group: KVCacheGroup, block_size: int) -> int:
    """One block of the group: its layers' pages."""
    return sum(specs[i].page_bytes(block_size) for i in group.layers)


def window_blocks(spec: KVCacheSpec, block_size: int, requests: int, step_tokens: int) -> int:
    """The most blocks a table behind a window of W tokens holds for `requests` requests at
    once: each the blocks of its W - 1 tokens before the step and its step's tokens (at most
    two partial ones), the step's tokens across the requests at most `step_tokens`."""
    window = spec.sliding_window or 1
    return requests * (-(-(window - 1) // block_size) + 2) + -(-step_tokens // block_size)


def split_pool(specs: Sequence[KVCacheSpec], groups: Sequence[KVCacheGroup], block_size: int,
               limits: SplitLimits, budget: int | None = None, first_blocks: int | None = None,
               first_extra_bytes: int = 0) -> tuple[KVCacheGroup, ...]:
    """The groups with their partitions' blocks (num_blocks), from the budget in bytes or from
    the first group's blocks (first_blocks, e.g. num_gpu_blocks_override: the others follow).
    first_extra_bytes: what a block of the first group costs beyond its layers (a drafter's
    cache on its tables)."""
    pages = [group_page_bytes(specs, g, block_size) for g in groups]
    pages[0] += first_extra_bytes
    seqs, step = limits.max_num_seqs, limits.max_num_batched_tokens
    bounded = [i for i, g in enumerate(groups) if i and g.spec.drops_blocks]
    need = {i: window_blocks(groups[i].spec, block_size, seqs, step) for i in bounded}
    if first_blocks is None:
        if budget is None:
            raise ValueError("split_pool needs a budget or the first group's blocks")
        reserved = sum(pages[i] * need[i] for i in bounded)
        if reserved > budget // 2:  # fewer requests' windows at once
            scale = budget / 2 / reserved
            need = {i: max(window_blocks(groups[i].spec, block_size, 1, step),
                           math.floor(need[i] * scale)) for i in bounded}
        rest = budget - sum(pages[i] * need[i] for i in bounded)
        # the whole-context groups: n_g = ceil(f_g n_0) + one partial block per request
        whole = [i for i in range(1, len(groups)) if i not in need]
        fixed = sum(pages[i] * (seqs + 1) for i in whole)
        per_first = pages[0] + sum(pages[i] * _fraction(groups[i], block_size) for i in whole)
        first_blocks = math.floor((rest - fixed) / per_first)
        if limits.max_model_len:  # (a budget left over is not allocated)
            first_blocks = min(first_blocks, FIRST_BLOCKS_CAP * seqs
                               * -(-limits.max_model_len // block_size))
        if first_blocks < 2:
            raise ValueError(
                f"not enough memory for the KV cache: {budget} bytes give {first_blocks} blocks "
                f"of the first KV cache group ({pages[0]} bytes each) beside the other groups' "
                "partitions; raise gpu_memory_utilization or kv_cache_memory_bytes")
    sizes = [first_blocks]
    for i in range(1, len(groups)):
        sizes.append(need[i] if i in need else
                     math.ceil(first_blocks * _fraction(groups[i], block_size)) + seqs + 1)
    return tuple(replace(g, num_blocks=n) for g, n in zip(groups, sizes))


def partitioned_pool(config: EngineConfig, specs: list[KVCacheSpec],
                     groups: Sequence[KVCacheGroup], device: torch.device, per_block: int,
                     non_kv_peak_bytes: int) -> tuple[tuple[KVCacheGroup, ...], int] | None:
    """The runner's groups with their partitions (every rank the tightest rank's), and the
    bytes a block of the first group costs with its share of the others (for the log); None
    where the groups share the pool. per_block: a shared pool's block with the drafter's
    pages (what is more than the layers' is the drafter's, on the first group's tables)."""
    bs = config.cache_config.block_size
    if not partitions_pool(specs, groups, bs):
        return None
    cc, sc = config.cache_config, config.scheduler_config
    extra = per_block - bytes_per_block(specs, groups, bs)
    budget = (None if cc.num_gpu_blocks_override is not None
              else kv_budget_bytes(cc, device, non_kv_peak_bytes))
    limits = SplitLimits(sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len)
    sized = split_pool(specs, groups, bs, limits, budget, cc.num_gpu_blocks_override, extra)
    sized = tuple(replace(g, num_blocks=world_min_int(g.num_blocks, device)) for g in sized)
    logger.info("KV cache groups with pool partitions of their own: %s blocks",
                ", ".join(str(g.num_blocks) for g in sized))
    return sized, partitioned_bytes(specs, sized, bs, extra) // sized[0].num_blocks


def _fraction(group: KVCacheGroup, block_size: int) -> float:
    return group.spec.held_fraction(block_size)


def partitioned_bytes(specs: Sequence[KVCacheSpec], groups: Sequence[KVCacheGroup],
                      block_size: int, first_extra_bytes: int = 0) -> int:
    """What the partitions' blocks cost (not their null pages)."""
    return sum((group_page_bytes(specs, g, block_size) + (first_extra_bytes if i == 0 else 0))
               * g.num_blocks for i, g in enumerate(groups))
