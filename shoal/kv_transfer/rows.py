"""The worker side of KV transfer: a request's token rows of every paged layer read out of the
paged cache (gather) and written into another engine's (scatter), whatever the two engines'
block sizes, each tensor-parallel rank taking its share of the KV heads.

A layer's cache is [planes, slots, Hk, D] (slot = block * block_size + offset; planes: K and
V, or MLA's one latent row). A payload (payload.py) holds per layer the rows [planes, N, H, D]
of tokens [0, N) with all H KV heads (the producer runs one rank), in the cache dtype, as raw
bytes (float8 has no index kernels on some devices, bytes have). Both directions take one
indexed copy per layer over the request's slots (never a loop over blocks or tokens); on CUDA
the host side is pinned and the copies are asynchronous. A tensor-parallel rank reads only its
heads' rows of the payload (shared with the other ranks of the host: shared.py).

A model of several KV cache groups (sliding-window layers beside full attention, windows of
several lengths) has one block table per group: each layer's rows follow its group's table
(LayerTables). A sliding layer sends only the tokens its window still reads at the prompt's
end (from num_tokens - window), and the consumer writes only those its window reads from the
first token it computes on (its table holds no block before them: KVCacheManager's
loaded_tokens)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from shoal.core.kv_cache_spec import KVCacheGroup
from shoal.distributed.parallel_state import get_tp_rank, get_tp_world_size
from shoal.kv_transfer.payload import KVLayout, KVPayload, host_buffer


def _slots(block_ids: list[int], block_size: int, start: int, end: int,
           device: torch.device) -> torch.Tensor:
    pos = torch.arange(start, end)
    table = torch.tensor(block_ids, dtype=torch.long)
    return (table[pos // block_size] * block_size + pos % block_size).to(device)


@dataclass(frozen=True)
class LayerTables:
    """Per paged layer: the KV cache group whose block table its rows follow (0: the first
    group's, KVLoad/KVSave.block_ids; g > 0: group_block_ids[g - 1]) and its sliding window
    (None: it keeps every token)."""

    groups: tuple[int, ...]
    windows: tuple[int | None, ...]

    @classmethod
    def of(cls, kv_groups: Sequence[KVCacheGroup]) -> LayerTables:
        group_of = {i: gi for gi, g in enumerate(kv_groups) for i in g.layers}
        n = len(group_of)
        return cls(tuple(group_of[i] for i in range(n)),
                   tuple(kv_groups[group_of[i]].sliding_window for i in range(n)))

    def first_sent(self, layer: int, num_tokens: int) -> int:
        """The first of a prompt's num_tokens whose rows the layer sends: a sliding layer's
        window at the prompt's last token reads keys from num_tokens - window on."""
        window = self.windows[layer]
        return 0 if window is None else max(0, num_tokens - window)

    def first_read(self, layer: int, start: int, end: int) -> int:
        """The first of tokens [start, end) the layer reads once it computes from `end` on."""
        window = self.windows[layer]
        return start if window is None else max(start, end - window + 1)


def _one_table(num_layers: int) -> LayerTables:
    return LayerTables((0,) * num_layers, (None,) * num_layers)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_of(caches: list[torch.Tensor], num_tokens: int,
              starts: Sequence[int] = ()) -> KVLayout:
    starts = list(starts) if any(starts) else []
    shapes = [[kv.shape[0], num_tokens - (starts[i] if starts else 0), kv.shape[2],
               kv.shape[3] * kv.element_size()] for i, kv in enumerate(caches)]
    return KVLayout(_dtype_name(caches[0].dtype), num_tokens, shapes, starts)


def _wide(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both uint8 row tensors viewed as the widest integers their rows divide into: CPU
    index_copy_ costs per element, so 8-byte elements write several times faster."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        size = dtype.itemsize
        if dst.shape[-1] % size == 0 and all(
                t.storage_offset() % size == 0 and all(st % size == 0 for st in t.stride()[:-1])
                for t in (dst, src)):
            return dst.view(dtype), src.view(dtype)
    return dst, src


def _host_tensor(data) -> torch.Tensor:
    """A uint8 tensor over a buffer, no copy (a read-only one, as TP ranks decode it, is only
    read)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "the buffer is not writable"
        return torch.frombuffer(data, dtype=torch.uint8)


class _Slots:
    """The slots of token ranges in each group's table, each range computed once."""

    def __init__(self, tables: list[list[int]], block_size: int, device: torch.device):
        self.tables, self.block_size, self.device = tables, block_size, device
        self._done: dict[tuple[int, int, int], torch.Tensor] = {}

    def __call__(self, group: int, start: int, end: int) -> torch.Tensor:
        key = (group, start, end)
        if key not in self._done:
            if group >= len(self.tables):
                raise ValueError(f"a layer of KV cache group {group}, but the request has "
                                 f"{len(self.tables)} block tables")
            self._done[key] = _slots(self.tables[group], self.block_size, start, end,
                                     self.device)
        return self._done[key]


def gather_rows(caches: list[torch.Tensor], block_ids: list[int], block_size: int,
                num_tokens: int, tables: LayerTables | None = None,
                group_block_ids: Sequence[list[int]] = ()) -> KVPayload:
    """Tokens [0, num_tokens) of every layer (a sliding layer's: those its window reads at
    the last one), into one host buffer. On CUDA the copies are queued (pinned memory): the
    payload's `ready` waits for them, so the step does not."""
    device = caches[0].device
    tables = tables or _one_table(len(caches))
    starts = [tables.first_sent(i, num_tokens) for i in range(len(caches))]
    layout = layout_of(caches, num_tokens, starts)
    cuda = device.type == "cuda"
    data = host_buffer(layout.nbytes, pinned=cuda)
    host = _host_tensor(data)
    slots_of = _Slots([block_ids, *group_block_ids], block_size, device)
    offset = 0
    for i, kv in enumerate(caches):
        size = layout.layer_nbytes(i)
        out = host[offset:offset + size].view(layout.layers[i])
        offset += size
        slots = slots_of(tables.groups[i], starts[i], num_tokens)
        if cuda:
            out.copy_(kv.view(torch.uint8).index_select(1, slots), non_blocking=True)
        else:
            torch.index_select(kv.view(torch.uint8), 1, slots, out=out)
    ready: Callable[[], None] | None = None
    if cuda:
        done = torch.cuda.Event()
        done.record()
        ready = done.synchronize
    return KVPayload(layout, data, ready)


def _head_slice(total: int, local: int, rank: int, world: int) -> slice:
    """The KV heads this rank holds of `total` (split, or one replicated head per rank)."""
    if local * world == total:
        return slice(rank * local, (rank + 1) * local)
    if local == 1 and total < world:
        h = rank * total // world
        return slice(h, h + 1)
    if local == total:
        return slice(0, total)
    raise ValueError(f"cannot place {total} transferred KV heads on a rank holding {local}")


def check_layout(caches: list[torch.Tensor], layout: KVLayout, nbytes: int) -> None:
    """ValueError when a payload cannot go into these caches."""
    if len(layout.layers) != len(caches):
        raise ValueError(f"the transferred KV has {len(layout.layers)} layers, this model "
                         f"{len(caches)}")
    if layout.dtype != _dtype_name(caches[0].dtype):
        raise ValueError(f"the transferred KV is {layout.dtype}, this cache {caches[0].dtype}")
    if nbytes != layout.nbytes:
        raise ValueError(f"the transferred KV has {nbytes} bytes, its layout says "
                         f"{layout.nbytes}")
    for kv, (planes, _, _, width) in zip(caches, layout.layers):
        if planes != kv.shape[0] or width != kv.shape[3] * kv.element_size():
            raise ValueError(f"the transferred KV rows are {planes} x {width} bytes a head, "
                             f"this cache's {kv.shape[0]} x {kv.shape[3] * kv.element_size()}")


def scatter_rows(caches: list[torch.Tensor], layout: KVLayout, data, block_ids: list[int],
                 block_size: int, start: int, num_tokens: int,
                 tables: LayerTables | None = None,
                 group_block_ids: Sequence[list[int]] = ()) -> int:
    """Writes rows [start, start + num_tokens) of a payload into the request's blocks (a
    sliding layer's: those its window reads from start + num_tokens on; its table holds no
    block before them): per layer one copy to the device (asynchronous from pinned memory)
    and one indexed write. On CUDA the caller keeps `data` alive until the device has read
    it. Returns the bytes of rows this rank takes: one of several takes only its own heads
    (about 1/tp of them)."""
    host = _host_tensor(data)
    check_layout(caches, layout, host.numel())
    device = caches[0].device
    tables = tables or _one_table(len(caches))
    end = start + num_tokens
    slots_of = _Slots([block_ids, *group_block_ids], block_size, device)
    rank, world = get_tp_rank(), get_tp_world_size()
    offset = read = 0
    for i, kv in enumerate(caches):
        size = layout.layer_nbytes(i)
        rows = host[offset:offset + size].view(layout.layers[i])
        offset += size
        first, sent = tables.first_read(i, start, end), layout.start(i)
        if sent > first:
            raise ValueError(f"layer {i}'s transferred rows start at token {sent}, but it "
                             f"reads from token {first}")
        if first >= end:
            continue
        slots = slots_of(tables.groups[i], first, end)
        lo, hi = first - sent, end - sent  # the payload's rows of tokens [first, end)
        heads = _head_slice(layout.layers[i][2], kv.shape[2], rank, world)
        src = rows[:, lo:hi, heads]
        read += src.numel()
        if device.type != "cpu":
            if src.shape[2] == rows.shape[2]:  # all heads: the whole layer in one copy
                src = rows.to(device, non_blocking=True)[:, lo:hi]
            else:  # this rank's heads only cross to the device (gathered on the host)
                src = src.contiguous().to(device, non_blocking=True)
        dst = kv.view(torch.uint8)
        if dst.device.type == "cpu":
            dst, src = _wide(dst, src)
        dst.index_copy_(1, slots, src)
    return read
