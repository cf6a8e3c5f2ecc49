"""Device <-> CPU-tier copies where a block's pages differ in shape between cache tensors, so a
CPU slot holds them as bytes (BlockLayout.grouped, grouped_cpu_tier.py):

- a partitioned pool (DeepSeek-V4: KV cache groups with pages of their own,
  shoal/worker/kv_cache_tensors.py allocate_partitioned): block id b of group g (its run
  [first_g, first_g + n_g), kv_cache_spec.pool_partitions) is page b - first_g + 1 of each
  of g's tensors ([planes, (n_g + 1) * block_size, Hk, D]); the runner's tensors come group
  after group, len(g.layers) of them each (one per layer), which page_groups checks;
- one KV cache group whose layers' rows differ (DeepSeek-V3.2: the latent rows and the
  indexer's keys): block id b is page b of every tensor.

A copy group's block fills a CPU slot of its own size with its tensors' pages back to back,
in the order of the tensors."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from shoal.core.kv_cache_spec import KVCacheGroup, pool_partitions
from shoal.host_to_device import to_device
from shoal.kv_offload.grouped_cpu_tier import GroupedCPUTier
from shoal.kv_offload.stats import TierStats
from shoal.kv_offload.transfer import KVTransfer, _runs


@dataclass
class PageGroup:
    """Tensors whose pages one block id names: block id b is page b - page_base of each."""

    first: int  # its first block id
    page_base: int
    tensors: list[torch.Tensor]


def page_bytes(kv: torch.Tensor, block_size: int) -> int:
    """One block's bytes of a [planes, slots, Hk, D] cache tensor."""
    return kv.shape[0] * block_size * kv.shape[2] * kv.shape[3] * kv.element_size()


def page_groups(kv_caches: Sequence[torch.Tensor], groups: Sequence[KVCacheGroup],
                block_size: int) -> list[PageGroup] | None:
    """The copy groups of the runner's tensors (checked against the KV cache groups' layers
    and partitions), or None where every tensor has one row and block ids name one page of
    each (the uniform layout of transfer.py)."""
    runs = pool_partitions(tuple(groups))
    if not runs:
        rows = {(kv.shape[0], *kv.shape[2:], kv.dtype) for kv in kv_caches}
        if len(rows) == 1 or len(groups) != 1:
            return None
        return [PageGroup(0, 0, list(kv_caches))]
    out, k = [], 0
    for gi, (g, (first, _)) in enumerate(zip(groups, runs)):
        mine = list(kv_caches[k:k + len(g.layers)])
        k += len(g.layers)
        slots = (g.num_blocks + 1) * block_size
        if len(mine) != len(g.layers) or any(kv.shape[1] != slots for kv in mine):
            raise ValueError(f"KV offloading: KV cache group {gi} ({len(g.layers)} layers, "
                             f"{g.num_blocks} blocks) does not match the runner's tensors "
                             f"{[tuple(kv.shape) for kv in mine]}")
        out.append(PageGroup(first, first - 1, mine))  # (page 0: the null block)
    if k != len(kv_caches):
        raise ValueError(f"KV offloading: {len(kv_caches)} KV cache tensors for groups of "
                         f"{k} layers")
    return out


@dataclass
class _Group:
    """One copy group's device pages as its CPU slots lay them out."""

    first: int  # its first block id
    page_base: int  # block id b is page b - page_base
    base: int  # its first CPU slot
    pool: torch.Tensor  # [slots, bytes] uint8, its rows of the CPU tier
    views: list[torch.Tensor]  # per tensor: [planes, pages, page bytes of a plane] uint8
    offsets: list[int]  # where each tensor's page starts in a slot
    nbytes: int  # a block's bytes

    def spans(self):
        for v, off in zip(self.views, self.offsets):
            yield v, off, v.shape[0] * v.shape[2]


class GroupedKVTransfer(KVTransfer):
    def __init__(self, groups: Sequence[PageGroup], tier: GroupedCPUTier, block_size: int,
                 cpu_stats: TierStats | None = None):
        """groups: page_groups' (group g's blocks in the CPU tier's group g slots)."""
        if len(groups) != len(tier.layout.group_bytes):
            raise ValueError(f"{len(groups)} copy groups for a CPU tier of "
                             f"{len(tier.layout.group_bytes)}")
        self.groups: list[_Group] = []
        for g, pg in enumerate(groups):
            offsets, off = [], 0
            for kv in pg.tensors:
                offsets.append(off)
                off += page_bytes(kv, block_size)
            if off != tier.layout.group_bytes[g]:
                raise ValueError(f"copy group {g}'s block is {off} bytes; the CPU tier's "
                                 f"layout says {tier.layout.group_bytes[g]}")
            views = [kv.view(torch.uint8).view(kv.shape[0], kv.shape[1] // block_size, -1)
                     for kv in pg.tensors]
            self.groups.append(_Group(pg.first, pg.page_base, tier.bases[g], tier.pools[g],
                                      views, offsets, off))
        self._firsts = [g.first for g in self.groups]
        self.block_bytes = tier.layout.nbytes
        self._init_copier(groups[0].tensors[0].device, cpu_stats)

    def _group_of(self, block: int) -> _Group:
        return self.groups[bisect_right(self._firsts, block) - 1]

    def _nbytes(self, blocks: list[int]) -> int:
        return sum(self._group_of(b).nbytes for b in blocks)

    def _by_group(self, pairs: list[tuple[int, int]]
                  ) -> list[tuple[_Group, list[int], list[int]]]:
        """(device block, slot) pairs -> per group: (group, pages, its pool's rows)."""
        split: dict[int, tuple[list[int], list[int]]] = {}
        for block, slot in pairs:
            gi = bisect_right(self._firsts, block) - 1
            g = self.groups[max(gi, 0)]
            row = slot - g.base
            if gi < 0 or not 0 <= row < g.pool.shape[0]:
                raise ValueError(f"KV transfer: block {block} and CPU slot {slot} are not of "
                                 "one KV cache group")
            pages, rows = split.setdefault(gi, ([], []))
            pages.append(block - g.page_base)
            rows.append(row)
        return [(self.groups[gi], pages, rows) for gi, (pages, rows) in split.items()]

    # -- CPU device ---------------------------------------------------------------------------
    def _store_cpu(self, stores: list[tuple[int, int]]) -> None:
        for g, pages, rows in self._by_group(stores):
            dev, dst = torch.tensor(pages), torch.tensor(rows)
            for v, off, n in g.spans():
                g.pool[dst, off:off + n] = v[:, dev].transpose(0, 1).reshape(len(pages), n)

    def _load_cpu(self, loads: list[tuple[int, int]]) -> None:
        for g, pages, rows in self._by_group([(d, s) for s, d in loads]):
            dev, src = torch.tensor(pages), torch.tensor(rows)
            for v, off, n in g.spans():
                v[:, dev] = g.pool[src, off:off + n].view(len(rows), v.shape[0], -1) \
                    .transpose(0, 1)

    # -- CUDA: a device staging buffer per group (run chunks the plan), runs of slots -------
    def _store_cuda(self, stores: list[tuple[int, int]]) -> None:
        for g, pages, rows in self._by_group(stores):
            dev = to_device(pages, torch.long, self.device)
            staging = torch.empty((len(pages), g.nbytes), dtype=torch.uint8, device=self.device)
            for v, off, n in g.spans():
                staging[:, off:off + n] = v[:, dev].transpose(0, 1).reshape(len(pages), n)
            for j, s, k in _runs(rows):
                g.pool[s:s + k].copy_(staging[j:j + k], non_blocking=True)

    def _load_cuda(self, loads: list[tuple[int, int]]) -> None:
        for g, pages, rows in self._by_group([(d, s) for s, d in loads]):
            dev = to_device(pages, torch.long, self.device)
            staging = torch.empty((len(pages), g.nbytes), dtype=torch.uint8, device=self.device)
            for j, s, k in _runs(rows):
                staging[j:j + k].copy_(g.pool[s:s + k], non_blocking=True)
            for v, off, n in g.spans():
                v[:, dev] = staging[:, off:off + n].view(len(pages), v.shape[0], -1) \
                    .transpose(0, 1)
