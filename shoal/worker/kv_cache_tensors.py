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
FP8 page all the same."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from shoal.core.kv_cache_spec import KVCacheGroup, KVCacheSpec, LinearStateSpec
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
