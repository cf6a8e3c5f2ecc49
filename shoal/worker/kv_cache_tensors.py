"""The device tensors of the paged KV cache, laid out as the layers' cache specs say
(shoal/core/kv_cache_spec.py), and which layer reads which.

A layer's cache is [planes, num_slots, Hk, D] (slot = block * block_size + offset; planes: K
and V, or MLA's one latent row). Layers of one shape share one allocation. When a model has
several KV cache groups whose layers are all of one shape (sliding-window layers beside full
ones), a block id belongs to one group at a time, so the j-th layer of every group shares one
tensor (vLLM's layout): a block costs the largest group's layers, not every layer's. A
linear-attention layer's state fills a page of the attention layers' row (its spec takes
that row here), so hybrids share tensors the same way.

The tensors' dtype is the pool's storage: the model dtype, or float8_e4m3fn for
kv_cache_dtype="fp8" (one byte a value, so a block costs half of bfloat16's and the pool gets
twice the blocks; attention/kv_quant.py). A linear state's float32 words fill the bytes of an
FP8 page all the same.

Groups whose layers' rows differ (DeepSeek-V4) would pay every layer's page for a block of any
group here; they get a partition of the pool each instead (partitions_pool,
worker/kv_pool_split.py): group g's tensors hold page 0 (the null block, zero) and its own
num_blocks pages, and its tables hold pages (kv_cache_spec.pool_partitions maps the pool's
block ids to them; PoolPages routes fault zeroing by id)."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from shoal.core.kv_cache_spec import KVCacheGroup, KVCacheSpec, LinearStateSpec, pool_partitions
from shoal.host_to_device import to_device
from shoal.worker.host_pages import populate
from shoal.worker.kv_cache_sizing import zeroed_host_tensor


def layer_specs(layers: Sequence, dtype: torch.dtype) -> list[KVCacheSpec]:
    return on_attention_pages([layer.kv_cache_spec(dtype.itemsize) for layer in layers])


def on_attention_pages(specs: list[KVCacheSpec]) -> list[KVCacheSpec]:
    """Linear-state specs with the page row of the (first) attention layers."""
    if not any(isinstance(s, LinearStateSpec) for s in specs):
        return specs
    rows = [s for s in specs if not isinstance(s, LinearStateSpec)]
    if not rows:
        raise ValueError("a model of linear-attention layers only has no attention pages to "
                         "hold their states (not supported yet)")
    a = rows[0]
    return [replace(s, num_kv_heads=a.num_kv_heads, head_size=a.head_size,
                    dtype_bytes=a.dtype_bytes, planes_of_page=a.planes)
            if isinstance(s, LinearStateSpec) else s for s in specs]


def _row(spec: KVCacheSpec, block_size: int) -> tuple[int, int, int]:
    return spec.slot_row(block_size)  # a compressed layer's page is narrower than its entry


def shares_tensors(specs: list[KVCacheSpec], groups: Sequence[KVCacheGroup],
                   block_size: int) -> bool:
    """Several groups whose layers are all of one shape: the groups share tensors."""
    return len(groups) > 1 and len({_row(s, block_size) for s in specs}) == 1


def partitions_pool(specs: list[KVCacheSpec], groups: Sequence[KVCacheGroup],
                    block_size: int) -> bool:
    """Several groups with tensors of their own (rows that differ, no linear states, whose
    pages live in attention pages): each group gets its own partition of the pool."""
    return (len(groups) > 1 and not shares_tensors(specs, groups, block_size)
            and not any(g.holds_state for g in groups))


def bytes_per_block(specs: list[KVCacheSpec], groups: Sequence[KVCacheGroup],
                    block_size: int) -> int:
    """What one block id costs across the layers."""
    if shares_tensors(specs, groups, block_size):
        return max(len(g.layers) for g in groups) * specs[0].page_bytes(block_size)
    return sum(s.page_bytes(block_size) for s in specs)


def allocate_kv_caches(layers: Sequence, specs: list[KVCacheSpec],
                       groups: Sequence[KVCacheGroup], num_slots: int, dtype: torch.dtype,
                       device: torch.device, block_size: int) -> list[torch.Tensor]:
    """Zeroed caches of num_slots slots, bound to the layers (each told its group); returns
    the distinct tensors (what fault zeroing and the KV tiers copy)."""
    if shares_tensors(specs, groups, block_size):
        caches = _allocate(max(len(g.layers) for g in groups), _row(specs[0], block_size),
                           num_slots, dtype, device)
        for gi, g in enumerate(groups):
            for j, i in enumerate(g.layers):
                if g.holds_state:
                    layers[i].bind_pages(caches[j], block_size)
                else:
                    layers[i].kv_cache = caches[j]
                layers[i].kv_group = gi
        return caches
    group_of = {i: gi for gi, g in enumerate(groups) for i in g.layers}
    caches: list[torch.Tensor] = []
    rows = [_row(s, block_size) for s in specs]
    for row in dict.fromkeys(rows):  # layers of one shape: one allocation
        idx = [i for i, r in enumerate(rows) if r == row]
        for i, kv in zip(idx, _allocate(len(idx), row, num_slots, dtype, device)):
            layers[i].kv_cache, layers[i].kv_group = kv, group_of.get(i, 0)
            caches.append(kv)
    return caches


@dataclass
class PoolPages:
    """A partitioned pool's tensors by group, and each group's run of block ids."""

    runs: tuple[tuple[int, int], ...]  # (first block id, count), kv_cache_spec.pool_partitions
    caches: tuple[list[torch.Tensor], ...]

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [kv for group in self.caches for kv in group]

    def zero(self, entries: list[tuple[int, int]], block_size: int) -> None:
        """(block id, first slot) as zero_blocks, each id in its group's tensors at its page
        (id 0, the null block: page 0 of every group)."""
        firsts = [first for first, _ in self.runs]
        by_group: list[list[tuple[int, int]]] = [[] for _ in self.runs]
        for block, slot in entries:
            if block == 0:
                for mine in by_group:
                    mine.append((0, slot))
                continue
            g = bisect_right(firsts, block) - 1
            first, n = self.runs[max(g, 0)]
            if g < 0 or block >= first + n:
                raise ValueError(f"block {block} is in no KV cache group's run {self.runs}")
            by_group[g].append((block - first + 1, slot))
        for caches, mine in zip(self.caches, by_group):
            if mine and caches:
                zero_blocks(caches, mine, block_size)


def allocate_partitioned(layers: Sequence, specs: list[KVCacheSpec],
                         groups: Sequence[KVCacheGroup], dtype: torch.dtype,
                         device: torch.device, block_size: int) -> PoolPages:
    """Each group's layers on tensors of its own: page 0 (the null block) and num_blocks
    pages; layers of one row within a group share one allocation."""
    per_group: list[list[torch.Tensor]] = []
    for gi, g in enumerate(groups):
        mine: list[torch.Tensor] = []
        rows = {i: _row(specs[i], block_size) for i in g.layers}
        for row in dict.fromkeys(rows.values()):
            idx = [i for i in g.layers if rows[i] == row]
            slots = (g.num_blocks + 1) * block_size
            for i, kv in zip(idx, _allocate(len(idx), row, slots, dtype, device)):
                layers[i].kv_cache, layers[i].kv_group = kv, gi
                mine.append(kv)
        per_group.append(mine)
    return PoolPages(pool_partitions(tuple(groups)), tuple(per_group))


def bind_pool(layers: Sequence, specs: list[KVCacheSpec], groups: Sequence[KVCacheGroup],
              num_blocks: int, linear_states: bool, dtype: torch.dtype, device: torch.device,
              block_size: int) -> tuple[int, list[torch.Tensor], PoolPages | None]:
    """The runner's pool bound to the layers: (the null block padding reads, the distinct
    tensors, a partitioned pool's tensors by group or None). A shared pool: num_blocks blocks,
    then the null block, then (linear states) the block their decode graphs' padding rows
    write. A partitioned one (groups sized, pool_partitions): page 0 of every group."""
    if pool_partitions(tuple(groups)):
        pages = allocate_partitioned(layers, specs, groups, dtype, device, block_size)
        return 0, pages.tensors, pages
    slots = (num_blocks + 1 + linear_states) * block_size
    return num_blocks, allocate_kv_caches(layers, specs, groups, slots, dtype, device,
                                          block_size), None


def zero_pool(caches: list[torch.Tensor], pages: PoolPages | None,
              entries: list[tuple[int, int]], block_size: int) -> None:
    """zero_blocks, or a partitioned pool's ids each in its group's pages."""
    if pages is not None:
        pages.zero(entries, block_size)
    else:
        zero_blocks(caches, entries, block_size)


def _allocate(n: int, row: tuple[int, int, int], num_slots: int, dtype: torch.dtype,
              device: torch.device) -> list[torch.Tensor]:
    planes, heads, head_size = row
    shape = (n, planes, num_slots, heads, head_size)
    if device.type == "cpu":
        cache = zeroed_host_tensor(shape, dtype)
        populate(cache, planes=n * planes)  # huge pages (host_pages.py)
    else:
        cache = torch.zeros(shape, dtype=dtype, device=device)
    return list(cache.unbind(0))


def zero_blocks(caches: list[torch.Tensor], entries: list[tuple[int, int]],
                block_size: int) -> None:
    """(block id, first slot): zeroes each block from that slot on, in every tensor (as
    bytes: zero bytes are 0.0 in every float dtype, and float8 has no index kernels on some
    devices)."""
    whole = [b for b, first in entries if first == 0]
    idx = to_device(whole, torch.long, caches[0].device) if whole else None
    for kv in caches:
        row = kv.shape[3] * kv.element_size()
        blocks = kv.view(torch.uint8).view(kv.shape[0], -1, block_size, kv.shape[2], row)
        if idx is not None:
            blocks[:, idx] = 0
        for b, first in entries:
            if first:
                blocks[:, b, first:] = 0
