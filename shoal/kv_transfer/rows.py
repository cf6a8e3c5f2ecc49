"""The worker side of KV transfer: a request's token rows of every paged layer read out of the
paged cache (gather) and written into another engine's (scatter), whatever the two engines'
block sizes, each tensor-parallel rank taking its share of the KV heads.

A layer's cache is [planes, slots, Hk, D] (slot = block * block_size + offset; planes: K and
V, or MLA's one latent row). A payload (payload.py) holds per layer the rows [planes, N, H, D]
of tokens [0, N) with all H KV heads (whatever the producer's ranks), in the cache dtype, as raw
bytes (float8 has no index kernels on some devices, bytes have). Both directions take one
indexed copy per layer over the request's slots (never a loop over blocks or tokens); on CUDA
the host side is pinned and the copies are asynchronous. A tensor-parallel rank reads only its
heads' rows of the payload (shared with the other ranks of the host: shared.py).

A model of several KV cache groups (sliding-window layers beside full attention, windows of
several lengths) has one block table per group: each layer's rows follow its group's table
(LayerTables). A sliding layer sends only the tokens its window still reads at the prompt's
end (from num_tokens - window), and the consumer writes only those its window reads from the
first token it computes on (its table holds no block before them: KVCacheManager's
loaded_tokens).

A linear-attention layer (hybrids) sends its recurrent state instead of rows: the state after
the payload's last token, read out of the block of its state table covering that token and
written into the consumer's block covering it (states.py); a hybrid's payload ends at a block
end of the producer, whose state its prefix caching keeps (p2p.py). The payload holds the
state of the whole model (every rank's channels and heads, in the model's order), and each
consumer rank takes its own slices of it.

A compressed layer (DeepSeek-V4's entries, one per complete group of tokens, CSA's with its
indexer key) sends its entries, not token rows: an entry's place in a page follows the block
size (entries.py), so each side finds them in its own blocks by index; the consumer writes
those of the groups its loaded tokens close. DeepSeek-V4's window rows and its compressors'
inputs of the open groups are one row a token in sliding tables (SlidingSharedKVSpec,
CompressorStateSpec): they move as any sliding layer's, the compressors' from the first
token of the oldest group their next entry still pools.

A tensor-parallel producer: every rank reads its own heads and TP rank 0 gathers them into one
payload of every head (tp_rows.py), and its ranks' linear-attention states into the model's
order (states.py), so the two sides' TP sizes may differ. A layer every rank holds whole (MLA's
latent row, indexer keys; all of DeepSeek-V4's caches and its MTP block's: one replicated KV
head) is read on rank 0 alone and never gathered (a model of such layers only, as V4, runs no
collective at all); a payload holds it once, and every consumer rank writes all of it."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from shoal.core.kv_cache_spec import (
    CompressedEntrySpec,
    KVCacheGroup,
    KVCacheSpec,
    LinearStateSpec,
)
from shoal.distributed.parallel_state import get_tp_rank, get_tp_world_size
from shoal.kv_transfer.entries import entry_bytes, read_entries, write_entries
from shoal.kv_transfer.payload import KVLayout, KVPayload, host_buffer
from shoal.kv_transfer.states import (
    rank_share,
    read_state,
    state_pages,
    to_model_order,
    write_state,
)
from shoal.kv_transfer.tp_rows import gather_to_first, kv_head_replicas, model_kv_heads


def token_slots(block_ids: list[int], block_size: int, start: int, end: int,
                device: torch.device) -> torch.Tensor:
    """The cache slots of tokens [start, end) in a block table."""
    pos = torch.arange(start, end)
    table = torch.tensor(block_ids, dtype=torch.long)
    return (table[pos // block_size] * block_size + pos % block_size).to(device)


@dataclass(frozen=True)
class LayerTables:
    """Per paged layer: the KV cache group whose block table its rows follow (0: the first
    group's, KVLoad/KVSave.block_ids; g > 0: group_block_ids[g - 1]), its sliding window
    (None: it keeps every token), its recurrent state's spec (a linear-attention layer; empty:
    none has one), how many consecutive tensor-parallel ranks hold the same rows (empty:
    each rank its own heads; tp_rows.py) and its compressed entries' spec (DeepSeek-V4's
    CSA / HCA entries; empty: none has them)."""

    groups: tuple[int, ...]
    windows: tuple[int | None, ...]
    states: tuple[LinearStateSpec | None, ...] = ()
    replicas: tuple[int, ...] = ()
    entries: tuple[CompressedEntrySpec | None, ...] = ()

    @classmethod
    def of(cls, kv_groups: Sequence[KVCacheGroup], specs: Sequence[KVCacheSpec] = (),
           hf_config: Any = None) -> LayerTables:
        """specs: every layer's own (default: its group's); hf_config: the model's, for its
        KV heads when fewer than the tensor-parallel ranks."""
        group_of = {i: gi for gi, g in enumerate(kv_groups) for i in g.layers}
        n = len(group_of)
        specs = list(specs) or [kv_groups[group_of[i]].spec for i in range(n)]
        states = tuple(s if isinstance(s, LinearStateSpec) else None for s in specs)
        entries = tuple(s if isinstance(s, CompressedEntrySpec) else None for s in specs)
        world = get_tp_world_size()
        return cls(tuple(group_of[i] for i in range(n)),
                   tuple(kv_groups[group_of[i]].sliding_window for i in range(n)),
                   states if any(states) else (),
                   kv_head_replicas(specs, model_kv_heads(hf_config), world) if world > 1
                   else (), entries if any(entries) else ())

    def state(self, layer: int) -> LinearStateSpec | None:
        return self.states[layer] if self.states else None

    def entry(self, layer: int) -> CompressedEntrySpec | None:
        return self.entries[layer] if self.entries else None

    @property
    def ratios(self) -> list[int]:
        """Per layer its entries' ratio (0: token rows), as KVLayout.ratios (empty: none)."""
        return [s.ratio if s is not None else 0 for s in self.entries]

    @property
    def state_layers(self) -> list[int]:
        return [i for i, s in enumerate(self.states) if s is not None]

    def first_sent(self, layer: int, num_tokens: int) -> int:
        """The first of a prompt's num_tokens whose rows the layer sends: a sliding layer's
        window at the prompt's last token reads keys from num_tokens - window on (a linear
        layer's state: the one after the last)."""
        if self.state(layer) is not None:
            return num_tokens - 1
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


def _row_shape(kv: torch.Tensor, layer: int, tables: LayerTables, num_tokens: int,
               start: int, gathered: torch.Tensor | None = None) -> list[int]:
    """[planes, rows, heads, width in bytes] of a layer's rows of this rank, or of every
    rank's that TP rank 0 `gathered` (tp_rows.py)."""
    spec = tables.state(layer)
    if gathered is not None:
        # a state layer gathered [1, 1, ranks, state bytes]: it goes as one row, in the
        # model's order (states.py)
        return [1, 1, 1, gathered.numel()] if spec is not None else list(gathered.shape)
    if spec is not None:
        return [1, 1, 1, spec.state_bytes]
    entry = tables.entry(layer)
    if entry is not None:
        return [1, num_tokens // entry.ratio, 1, entry_bytes(entry)]
    return [kv.shape[0], num_tokens - start, kv.shape[2], kv.shape[3] * kv.element_size()]


def layout_of(caches: list[torch.Tensor], num_tokens: int, starts: Sequence[int] = (),
              tables: LayerTables | None = None,
              gathered: dict[int, torch.Tensor] | None = None) -> KVLayout:
    """gathered: the layers TP rank 0 gathered of every rank, by index (the others: its
    own rows)."""
    tables = tables or _one_table(len(caches))
    starts = list(starts) if any(starts) else []
    gathered = gathered or {}
    shapes = [_row_shape(kv, i, tables, num_tokens, starts[i] if starts else 0,
                         gathered.get(i)) for i, kv in enumerate(caches)]
    return KVLayout(_dtype_name(caches[0].dtype), num_tokens, shapes, starts,
                    tables.state_layers, tables.ratios)


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

    def table(self, group: int) -> list[int]:
        if group >= len(self.tables):
            raise ValueError(f"a layer of KV cache group {group}, but the request has "
                             f"{len(self.tables)} block tables")
        return self.tables[group]

    def __call__(self, group: int, start: int, end: int) -> torch.Tensor:
        key = (group, start, end)
        if key not in self._done:
            self._done[key] = token_slots(self.table(group), self.block_size, start, end,
                                          self.device)
        return self._done[key]


def _read_layer(kv: torch.Tensor, layer: int, tables: LayerTables, slots_of: _Slots,
                start: int, num_tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """A layer's rows of tokens [start, num_tokens) (a linear layer's state after the last),
    this rank's heads, as uint8 [planes, rows, heads, width]: into `out` (a host buffer's
    slice; queued on CUDA), or a new tensor on the cache's device. A compressed layer: its
    entries of the complete groups of [0, num_tokens)."""
    spec, entry = tables.state(layer), tables.entry(layer)
    if spec is not None:
        table = slots_of.tables[tables.groups[layer]]
        rows = read_state(state_pages(kv, slots_of.block_size, spec),
                          table[(num_tokens - 1) // slots_of.block_size])
    elif entry is not None:
        rows = read_entries(kv, entry, slots_of.table(tables.groups[layer]),
                            slots_of.block_size, num_tokens)
    else:
        slots = slots_of(tables.groups[layer], start, num_tokens)
        if out is not None and out.device == kv.device:  # (CPU: no intermediate copy)
            return torch.index_select(kv.view(torch.uint8), 1, slots, out=out)
        rows = kv.view(torch.uint8).index_select(1, slots)
    if out is None:
        return rows
    return out.copy_(rows, non_blocking=True)


def gather_rows(caches: list[torch.Tensor], block_ids: list[int], block_size: int,
                num_tokens: int, tables: LayerTables | None = None,
                group_block_ids: Sequence[list[int]] = (), draft: KVLayout | None = None,
                into: Any = None) -> KVPayload | None:
    """Tokens [0, num_tokens) of every layer (a sliding layer's: those its window reads at
    the last one; a linear layer's state after it), into one host buffer. On CUDA the copies
    are queued (pinned memory): the payload's `ready` waits for them, so the step does not.
    With several tensor-parallel ranks every rank calls it (a collective): TP rank 0 gets
    the payload of every KV head, the others None. draft: a drafter's layout whose bytes the
    buffer keeps room for after these layers' (draft_rows.py fills them once the drafter has
    mirrored the step); into: the buffer to fill (layout.nbytes bytes) instead of a new one."""
    device = caches[0].device
    tables = tables or _one_table(len(caches))
    starts = [tables.first_sent(i, num_tokens) for i in range(len(caches))]
    slots_of = _Slots([block_ids, *group_block_ids], block_size, device)
    gathered: dict[int, torch.Tensor] = {}
    world = get_tp_world_size()
    if world > 1:
        # layers every rank holds whole (a latent row, DeepSeek-V4's replicated caches) are
        # rank 0's own: read there alone, never gathered; the others' heads are
        replicas = tables.replicas or (1,) * len(caches)
        split = [i for i, rep in enumerate(replicas) if rep < world]
        if split:
            local = [_read_layer(caches[i], i, tables, slots_of, starts[i], num_tokens)
                     for i in split]
            parts = gather_to_first(local, [replicas[i] for i in split])
            if parts is None:
                return None
            gathered = dict(zip(split, parts))
        elif get_tp_rank() != 0:
            return None
    layout = layout_of(caches, num_tokens, starts, tables, gathered)
    if draft is not None:
        layout = replace(layout, draft=draft)
    cuda = device.type == "cuda"
    data = host_buffer(layout.nbytes, pinned=cuda) if into is None else into
    if memoryview(data).nbytes != layout.nbytes:
        raise ValueError(f"a buffer of {memoryview(data).nbytes} bytes for KV rows of "
                         f"{layout.nbytes}")
    host = _host_tensor(data)
    offset = 0
    for i, kv in enumerate(caches):
        size = layout.layer_nbytes(i)
        out = host[offset:offset + size].view(layout.layers[i])
        offset += size
        spec = tables.state(i)
        if i in gathered and spec is not None:
            to_model_order(gathered[i].view(gathered[i].shape[2], -1), spec, out.view(-1))
        elif i in gathered:
            out.copy_(gathered[i], non_blocking=True)
        else:
            _read_layer(kv, i, tables, slots_of, starts[i], num_tokens, out)
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


def check_layout(caches: list[torch.Tensor], layout: KVLayout, nbytes: int,
                 tables: LayerTables | None = None) -> None:
    """ValueError when a payload cannot go into these caches (this rank's of the tensor-
    parallel group's)."""
    tables = tables or _one_table(len(caches))
    if len(layout.layers) != len(caches):
        raise ValueError(f"the transferred KV has {len(layout.layers)} layers, this model "
                         f"{len(caches)}")
    if layout.dtype != _dtype_name(caches[0].dtype):
        raise ValueError(f"the transferred KV is {layout.dtype}, this cache {caches[0].dtype}")
    if nbytes != layout.nbytes:
        raise ValueError(f"the transferred KV has {nbytes} bytes, its layout says "
                         f"{layout.nbytes}")
    if layout.states != tables.state_layers:
        raise ValueError(f"the transferred KV has linear-attention states in layers "
                         f"{layout.states}, this model in {tables.state_layers}")
    if layout.ratios != tables.ratios and any(layout.ratios + tables.ratios):
        raise ValueError(f"the transferred KV has compressed entries of ratios "
                         f"{layout.ratios or 'none'}, this model {tables.ratios or 'none'}")
    world = get_tp_world_size()
    for i, (kv, (planes, _, heads, width)) in enumerate(zip(caches, layout.layers)):
        spec, entry = tables.state(i), tables.entry(i)
        if entry is not None:
            if (planes, heads, width) != (1, 1, entry_bytes(entry)):
                raise ValueError(f"the transferred entries of layer {i} are {planes} x "
                                 f"{heads} x {width} bytes, this model's 1 x 1 x "
                                 f"{entry_bytes(entry)}")
            continue
        if spec is not None:  # the whole model's state: every rank's of this group
            if (planes, heads, width) != (1, 1, world * spec.state_bytes):
                raise ValueError(f"the transferred linear-attention state of layer {i} is "
                                 f"{planes} x {heads} x {width} bytes; this model's at "
                                 f"{world} tensor-parallel ranks is 1 x 1 x "
                                 f"{world * spec.state_bytes} ({world} ranks of "
                                 f"{spec.state_bytes})")
            continue
        want = (kv.shape[0], kv.shape[3] * kv.element_size())
        if (planes, width) != want:
            raise ValueError(f"the transferred KV rows of layer {i} are {planes} x {width} "
                             f"bytes a head, this cache's {want[0]} x {want[1]}")


def scatter_rows(caches: list[torch.Tensor], layout: KVLayout, data, block_ids: list[int],
                 block_size: int, start: int, num_tokens: int,
                 tables: LayerTables | None = None,
                 group_block_ids: Sequence[list[int]] = ()) -> int:
    """Writes rows [start, start + num_tokens) of a payload into the request's blocks (a
    sliding layer's: those its window reads from start + num_tokens on; its table holds no
    block before them; a linear layer's state, which must follow the payload's last token,
    into the block of its table covering that token): per layer one copy to the device
    (asynchronous from pinned memory) and one indexed write. On CUDA the caller keeps `data`
    alive until the device has read it. Returns the bytes of rows this rank takes: one of
    several takes only its own heads (about 1/tp of them). A drafter's rows after these
    layers' (layout.draft) are draft_rows.py's to write."""
    host = _host_tensor(data)
    tables = tables or _one_table(len(caches))
    check_layout(caches, layout, host.numel(), tables)
    device = caches[0].device
    end = start + num_tokens
    if tables.states and end != layout.num_tokens:
        raise ValueError(f"the transferred linear-attention states follow token "
                         f"{layout.num_tokens - 1}, but the load ends at token {end - 1}")
    slots_of = _Slots([block_ids, *group_block_ids], block_size, device)
    rank, world = get_tp_rank(), get_tp_world_size()
    offset = read = 0
    for i, kv in enumerate(caches):
        size = layout.layer_nbytes(i)
        rows = host[offset:offset + size].view(layout.layers[i])
        offset += size
        spec = tables.state(i)
        if spec is not None:
            src = rank_share(rows, spec, rank, world)
            table = slots_of.tables[tables.groups[i]]
            write_state(state_pages(kv, block_size, spec), table[(end - 1) // block_size],
                        src)
            read += src.numel()
            continue
        entry = tables.entry(i)
        if entry is not None:  # those of the groups closing in [start, end)
            lo, hi = start // entry.ratio, end // entry.ratio
            src = rows[0, lo:hi, 0]
            write_entries(kv, entry, slots_of.table(tables.groups[i]), block_size, lo, src)
            read += src.numel()
            continue
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
