"""Attention over the paged KV cache with the Triton kernels (the GPU fast path).

Same semantics as shoal.attention.torch_backend.paged_attention: write the step's keys and
values into their slots, then attend the decode rows (tokens [0, num_decode_rows), one query
each) with the decode kernel and the prefill chunks (the remaining tokens) with the prefill
kernel. One row per request in every per-request tensor, decodes first.
paged_attention_triton_fused takes q and k before their per-head RMSNorm and rotary and
applies both in the cache-write kernel: one launch where the layer made up to four.

CUDA graphs: every tensor shape and launch parameter must depend on the padded sizes only.
The backend's graph buffers (alloc_graph_buffers / fill_graph_buffers / graph_metadata, for
shoal/worker/graph_table.py) fix them: rows past the real ones get seq_len 0, slot -1 and
produce zeros, tables have a fixed width, the split-K grid a fixed size. Eager callers may
ask for the same with pad_decodes_to, block_table_width and decode_num_splits.

An FP8 cache (kv_cache_dtype="fp8") goes through the same kernels, their KV_FP8 variants
(picked from the cache's dtype): the scales are plain floats, constants of a captured graph.
So is a layer's soft cap (Gemma 2), which picks the kernels' SOFTCAP variants: every path
(decode, split-K decode, prefill and chunked prefill, windows, sinks, the fused rotary write)
applies it."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shoal.attention.backend import AttentionBackend
from shoal.attention.metadata import token_slots
from shoal.attention.ops.kv_cache_write import write_kv_cache
from shoal.attention.ops.mla_cache_write import write_mla_cache
from shoal.attention.ops.mla_decode import mla_paged_decode
from shoal.attention.ops.mla_prefill import mla_paged_prefill
from shoal.attention.ops.mla_sparse import SparseRows, mla_sparse_attention
from shoal.attention.ops.paged_decode import paged_decode
from shoal.attention.ops.paged_prefill import paged_prefill
from shoal.attention.ops.rope_kv_write import rope_kv_write
from shoal.attention.ops.warm import warm_latent_attention, warm_paged_attention
from shoal.host_to_device import lists_to_device


@dataclass
class TritonAttentionMetadata:
    num_tokens: int  # T, padded decode rows included
    slot_mapping: torch.Tensor  # [T] int64; -1 for padded rows (nothing written)
    block_size: int
    num_decodes: int  # real decode requests
    num_decode_rows: int  # decode rows incl. padding: tokens and requests [0, num_decode_rows)
    num_prefills: int  # prefill requests, rows [num_decode_rows, num_decode_rows + P)
    block_tables: torch.Tensor  # [R, N] int32; entries past a request's blocks are 0
    seq_lens: torch.Tensor  # [R] int32, context + query tokens; 0 for padded rows
    context_lens: torch.Tensor  # [R] int32
    query_start_loc: torch.Tensor  # [R + 1] int32, token offset of each request's queries
    max_query_len: int  # longest prefill chunk (0 without prefills)
    max_decode_seq_len: int
    max_seq_len: int
    sliding_window: int | None
    decode_num_splits: int | None  # None: paged_decode chooses from max_decode_seq_len
    # each table row's (query tokens, context) on the host: eager metadata only (None in a
    # graph's, whose lengths change between replays); V3.2's indexer cuts its scores to them
    host_lens: tuple[tuple[int, int], ...] | None = None


def build_triton_attention_metadata(**kwargs: Any) -> TritonAttentionMetadata:
    """triton_metadata_and_inputs's metadata alone (the same keyword arguments)."""
    return triton_metadata_and_inputs(**kwargs)[0]


def triton_metadata_and_inputs(
    *,
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_decodes: int,
    sliding_window: int | None,
    device: torch.device,
    pad_decodes_to: int | None = None,
    block_table_width: int | None = None,
    decode_num_splits: int | None = None,
    carry: Sequence[Sequence[int]] = (),
) -> tuple[TritonAttentionMetadata, list[torch.Tensor]]:
    """Inputs as for build_attention_metadata. pad_decodes_to >= num_decodes pads the decode
    group with dummy rows (their query tokens must sit at flat positions [num_decodes,
    pad_decodes_to), before any prefill token); block_table_width fixes N. Returns the
    metadata and `carry` (int64 lists: a step's token ids, positions...) on the device, all
    in one host-to-device copy."""
    n_req = len(query_lens)
    if not (len(context_lens) == len(block_tables) == n_req and 0 <= num_decodes <= n_req):
        raise ValueError("query_lens, context_lens and block_tables must have one entry per "
                         "request, and num_decodes <= that count")
    if any(q != 1 for q in query_lens[:num_decodes]):
        raise ValueError("decode requests must have exactly one query token")
    pad = num_decodes if pad_decodes_to is None else pad_decodes_to
    if pad < num_decodes:
        raise ValueError(f"pad_decodes_to {pad} < num_decodes {num_decodes}")
    n_pad = pad - num_decodes
    seq = [c + q for c, q in zip(context_lens, query_lens)]
    need = max((-(-s // block_size) for s in seq), default=0)
    width = need if block_table_width is None else block_table_width
    if need > width:
        raise ValueError(f"a request needs {need} blocks, block_table_width is {width}")
    width = max(width, 1)

    nd = num_decodes
    slots = (token_slots(query_lens[:nd], context_lens[:nd], block_tables[:nd], block_size)
             + [-1] * n_pad
             + token_slots(query_lens[nd:], context_lens[nd:], block_tables[nd:], block_size))

    def rows(vals: list[int], fill: int) -> list[int]:  # padded rows after the decodes
        return vals[:num_decodes] + [fill] * n_pad + vals[num_decodes:]

    tables = [(t[:width] + [0] * (width - len(t)))[:width] for t in block_tables]
    tables = tables[:num_decodes] + [[0] * width for _ in range(n_pad)] + tables[num_decodes:]
    starts = [0]
    for q in rows(query_lens, 1):
        starts.append(starts[-1] + q)

    flat_tables = [b for t in tables for b in t]
    slot_t, tables_t, seq_t, ctx_t, starts_t, *carried = lists_to_device(
        [(slots, torch.long), (flat_tables, torch.int32), (rows(seq, 0), torch.int32),
         (rows(context_lens, 0), torch.int32), (starts, torch.int32),
         *((c, torch.long) for c in carry)], device)
    return TritonAttentionMetadata(
        num_tokens=len(slots),
        slot_mapping=slot_t,
        block_size=block_size,
        num_decodes=num_decodes,
        num_decode_rows=pad,
        num_prefills=n_req - num_decodes,
        block_tables=tables_t.view(len(tables), width),
        seq_lens=seq_t,
        context_lens=ctx_t,
        query_start_loc=starts_t,
        max_query_len=max(query_lens[num_decodes:], default=0),
        max_decode_seq_len=max(seq[:num_decodes], default=0),
        max_seq_len=max(seq, default=0),
        sliding_window=sliding_window,
        decode_num_splits=decode_num_splits,
        host_lens=tuple(zip(rows(query_lens, 1), rows(context_lens, 0))),
    ), carried


def paged_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           kv_cache: torch.Tensor, md: TritonAttentionMetadata,
                           scale: float, sinks: torch.Tensor | None = None,
                           k_scale: float = 1.0, v_scale: float = 1.0,
                           softcap: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hk, D]; kv_cache: [2, num_slots, Hk, D]; sinks: [Hq] or None;
    k_scale, v_scale: an FP8 cache's scales; softcap: scores capped as
    softcap * tanh(s / softcap), or None. Returns [T, Hq, D]."""
    _check_tokens(q, md)
    write_kv_cache(kv_cache, k, v, md.slot_mapping, k_scale, v_scale)
    return _attend_cached(q, kv_cache, md, scale, sinks, k_scale, v_scale, softcap)


def paged_attention_triton_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                                 q_norm_weight: torch.Tensor | None,
                                 k_norm_weight: torch.Tensor | None, eps: float,
                                 kv_cache: torch.Tensor, md: TritonAttentionMetadata,
                                 scale: float, sinks: torch.Tensor | None = None,
                                 k_scale: float = 1.0, v_scale: float = 1.0,
                                 softcap: float | None = None) -> torch.Tensor:
    """paged_attention_triton on q and k before their per-head RMSNorm (weights None: none)
    and neox rotary, which one kernel applies while writing the cache (see
    ops/rope_kv_write.py). q is rotated in place; k is left as it was."""
    _check_tokens(q, md)
    rope_kv_write(positions, q, k, v, cos_sin_cache, kv_cache, md.slot_mapping,
                  q_norm_weight, k_norm_weight, eps, k_scale, v_scale)
    return _attend_cached(q, kv_cache, md, scale, sinks, k_scale, v_scale, softcap)


def _check_tokens(q: torch.Tensor, md: TritonAttentionMetadata) -> None:
    if q.shape[0] != md.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens, metadata {md.num_tokens}")


def _attend_cached(q: torch.Tensor, kv_cache: torch.Tensor, md: TritonAttentionMetadata,
                   scale: float, sinks: torch.Tensor | None, k_scale: float,
                   v_scale: float, softcap: float | None = None) -> torch.Tensor:
    """Decode and prefill attention over a cache that already holds the step's keys."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    nd = md.num_decode_rows
    if nd:
        paged_decode(q[:nd], kv_cache, md.block_tables[:nd], md.seq_lens[:nd], md.block_size,
                     scale, sliding_window=md.sliding_window, num_splits=md.decode_num_splits,
                     max_seq_len=md.max_decode_seq_len, out=out[:nd], sinks=sinks,
                     k_scale=k_scale, v_scale=v_scale, softcap=softcap)
    if md.num_prefills:
        # Whole tensors and first_row, not slices: see paged_prefill's kernel.
        paged_prefill(q, kv_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                      md.max_query_len, md.block_size, scale,
                      sliding_window=md.sliding_window, out=out, first_row=nd, sinks=sinks,
                      k_scale=k_scale, v_scale=v_scale, softcap=softcap)
    return out


def latent_attention_triton(q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                            md: TritonAttentionMetadata, scale: float,
                            v_dim: int, kv_scale: float = 1.0,
                            select: SparseRows | None = None) -> torch.Tensor:
    """MLA (AttentionBackend.forward_mla) with the Triton kernels: q [T, H, Dk], latent
    [T, Dk], kv_cache [1, slots, 1, Dk] (kv_scale: an FP8 cache's scale of the row). Same
    row layout as paged_attention_triton. select (DeepSeek-V3.2): the positions each query
    row reads, every row of the step (decodes and prefill tokens) through the sparse kernel;
    None: all it may see."""
    _check_tokens(q, md)
    if select is not None and not isinstance(select, SparseRows):
        raise TypeError(f"the Triton backend's sparse MLA takes SparseRows (the indexer's "
                        f"picks on its metadata), got {type(select).__name__}")
    cache = kv_cache.view(kv_cache.shape[1], kv_cache.shape[3])
    write_mla_cache(latent, cache, md.slot_mapping, kv_scale)
    if select is not None:
        return mla_sparse_attention(q, cache, md.block_tables, select, md.block_size, scale,
                                    v_dim, kv_scale=kv_scale)
    out = torch.empty(q.shape[0], q.shape[1], v_dim, dtype=q.dtype, device=q.device)
    nd = md.num_decode_rows
    if nd:
        mla_paged_decode(q[:nd], cache, md.block_tables[:nd], md.seq_lens[:nd], md.block_size,
                         scale, v_dim, num_splits=md.decode_num_splits,
                         max_seq_len=md.max_decode_seq_len, out=out[:nd], kv_scale=kv_scale)
    if md.num_prefills:
        mla_paged_prefill(q, cache, md.block_tables, md.seq_lens, md.query_start_loc,
                          md.max_query_len, md.block_size, scale, v_dim, out=out,
                          first_row=nd, kv_scale=kv_scale)
    return out


@dataclass
class TritonGraphBuffers:
    """Persistent inputs of the captured graphs; a graph of R rows of q tokens uses rows
    [0, R) of the per-request buffers and tokens [0, R * q) of slot_mapping."""

    block_size: int
    sliding_window: int | None
    slot_mapping: torch.Tensor  # [max_tokens] int64; -1: write nothing
    block_tables: torch.Tensor  # [max_rows, max_blocks] int32
    # [3 * max_rows + 1] int32: a graph of R rows reads seq_lens from [0, R), context_lens
    # from [R, 2R) and query_start_loc from [2R, 3R + 1), so a step's lengths are one copy.
    meta: torch.Tensor
    # Host staging (pinned on CUDA), so each step is one copy per dtype, each from a
    # contiguous host range (a strided source would be copied through a pageable temporary,
    # which can make the host wait). Two sets used in turn: step N+1 may be filled while
    # step N's copies are still queued.
    host_meta: Any = None  # 2 x numpy [3 * max_rows + 1] int32
    host_slots: Any = None  # 2 x numpy [max_tokens] int64
    host_tables: Any = None  # 2 x numpy [max_rows * max_blocks] int32, rows of the step's width
    turn: int = 0


class TritonAttentionBackend(AttentionBackend):
    """The AttentionBackend interface in full: fused rotary + cache write, CUDA graphs of
    every step shape, latent attention (sparse too), attention sinks, soft-capping, FP8
    caches."""

    name = "triton"
    supports_cuda_graphs = True
    supports_mla = True
    supports_sinks = True
    supports_softcap = True
    supports_sparse_mla = True
    supports_fp8_kv_cache = True

    def __init__(self, fuse_rope_and_cache_write: bool = True) -> None:
        # Layers with rotary hand q, k, v before norm and rotary to forward_fused, which does
        # both in the cache-write kernel; off (the engine's fuse_rope_kv_write) for A/B timing.
        self.fuses_rope_and_cache_write = fuse_rope_and_cache_write

    def build_metadata(self, *, query_lens: list[int], context_lens: list[int],
                       block_tables: list[list[int]], block_size: int, num_decodes: int,
                       sliding_window: int | None, device: torch.device,
                       null_block: int) -> TritonAttentionMetadata:
        del null_block  # the kernels never read past a sequence's length
        return build_triton_attention_metadata(
            query_lens=query_lens, context_lens=context_lens, block_tables=block_tables,
            block_size=block_size, num_decodes=num_decodes, sliding_window=sliding_window,
            device=device)

    def build_metadata_and_inputs(self, *, carry: Sequence[Sequence[int]], null_block: int,
                                  **metadata: Any
                                  ) -> tuple[TritonAttentionMetadata, list[torch.Tensor]]:
        del null_block
        return triton_metadata_and_inputs(carry=carry, **metadata)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, md: TritonAttentionMetadata,
                scale: float, sinks: torch.Tensor | None = None, *, k_scale: float = 1.0,
                v_scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
        return paged_attention_triton(q, k, v, kv_cache, md, scale, sinks, k_scale, v_scale,
                                      softcap)

    def forward_fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
                      eps: float, kv_cache: torch.Tensor, md: TritonAttentionMetadata,
                      scale: float, sinks: torch.Tensor | None = None, *,
                      k_scale: float = 1.0, v_scale: float = 1.0,
                      softcap: float | None = None) -> torch.Tensor:
        """forward on q and k before their optional per-head RMSNorm and rotary (see
        paged_attention_triton_fused); only while fuses_rope_and_cache_write."""
        return paged_attention_triton_fused(q, k, v, positions, cos_sin_cache, q_norm_weight,
                                            k_norm_weight, eps, kv_cache, md, scale, sinks,
                                            k_scale, v_scale, softcap)

    def forward_mla(self, q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                    md: TritonAttentionMetadata, scale: float, v_dim: int,
                    select: SparseRows | None = None, *,
                    kv_scale: float = 1.0) -> torch.Tensor:
        return latent_attention_triton(q, latent, kv_cache, md, scale, v_dim, kv_scale,
                                       select)

    def warm_kernels(self, kv_cache: torch.Tensor, num_heads: int, scale: float,
                     block_size: int, sliding_window: int | None,
                     q_dtype: torch.dtype | None = None,
                     softcaps: Collection[float | None] = (None,)) -> int:
        return warm_paged_attention(kv_cache, num_heads, scale, block_size, sliding_window,
                                    q_dtype, softcaps)

    def warm_mla_kernels(self, kv_cache: torch.Tensor, num_heads: int, scale: float,
                         block_size: int, v_dim: int, q_dtype: torch.dtype | None = None) -> int:
        return warm_latent_attention(kv_cache, num_heads, scale, block_size, v_dim, q_dtype)

    def alloc_graph_buffers(self, max_rows: int, max_tokens: int, max_blocks: int,
                            device: torch.device, *, block_size: int,
                            sliding_window: int | None) -> TritonGraphBuffers:
        pin = device.type == "cuda"

        def host(n: int, dtype: torch.dtype) -> Any:
            return [torch.zeros(n, dtype=dtype, pin_memory=pin).numpy() for _ in range(2)]

        return TritonGraphBuffers(
            block_size=block_size,
            sliding_window=sliding_window,
            slot_mapping=torch.full((max_tokens,), -1, dtype=torch.long, device=device),
            block_tables=torch.zeros(max_rows, max_blocks, dtype=torch.int32, device=device),
            meta=torch.zeros(3 * max_rows + 1, dtype=torch.int32, device=device),
            host_meta=host(3 * max_rows + 1, torch.int32),
            host_slots=host(max_tokens, torch.long),
            host_tables=host(max_rows * max_blocks, torch.int32),
        )

    def fill_graph_buffers(self, buf: TritonGraphBuffers, rows: int, q: int,
                           context_lens: list[int], block_tables: list[list[int]] | None,
                           slot_mapping: list[int]) -> None:
        """Rows [0, n) from the lists, rows [n, rows) padding. A decode padding row (q = 1)
        has seq_len 0 and gives zeros; a padding row of q > 1 tokens is q tokens at positions
        [0, q) over block-table entries left from earlier fills (finite cache values) and
        writes nothing: its outputs are never read. block_tables None keeps the tables of the
        previous fill (the caller knows they did not change). Host staging alternates
        between two sets: a fill must not come before the copies of the fill two before it
        have completed (one step at most is in flight, so they have)."""
        n = len(context_lens)
        if n > rows or rows * q > buf.slot_mapping.shape[0] or len(slot_mapping) != n * q:
            raise ValueError(f"{n} requests of {q} tokens ({len(slot_mapping)} slots) do not "
                             f"fit a graph of {rows} rows")
        turn = buf.turn
        buf.turn ^= 1
        meta, slots = buf.host_meta[turn][:3 * rows + 1], buf.host_slots[turn][:rows * q]
        meta[rows:rows + n] = context_lens  # layout: see TritonGraphBuffers.meta
        meta[rows + n:2 * rows] = 0
        meta[:rows] = meta[rows:2 * rows] + q
        if q == 1:
            meta[n:rows] = 0
        meta[2 * rows:] = np.arange(0, (rows + 1) * q, q, dtype=np.int32)
        slots[:n * q] = slot_mapping
        slots[n * q:] = -1
        buf.meta[:3 * rows + 1].copy_(torch.from_numpy(meta), non_blocking=True)
        buf.slot_mapping[:rows * q].copy_(torch.from_numpy(slots), non_blocking=True)
        if block_tables is not None and n:
            self._fill_tables(buf, turn, block_tables, _window_columns(buf, q))

    def graph_metadata(self, buf: TritonGraphBuffers, rows: int, q: int,
                       blocks: int | None = None) -> TritonAttentionMetadata:
        """Metadata over views of the buffers for a graph of rows x q tokens: decode rows
        (the decode kernel) for q = 1, else q-token chunks (the prefill kernel). Host-side
        values depend on the shape only: the split count comes from the table capacity.
        blocks: the tables' first columns only (a graph for requests of at most that many
        blocks); None: all of them."""
        tables = buf.block_tables[:rows]
        if blocks is not None:
            if not 0 < blocks <= tables.shape[1]:
                raise ValueError(f"blocks must be in [1, {tables.shape[1]}], got {blocks}")
            tables = tables[:, :blocks]
        cap = tables.shape[1] * buf.block_size
        decode = q == 1
        return TritonAttentionMetadata(
            num_tokens=rows * q,
            slot_mapping=buf.slot_mapping[:rows * q],
            block_size=buf.block_size,
            num_decodes=rows if decode else 0,
            num_decode_rows=rows if decode else 0,
            num_prefills=0 if decode else rows,
            block_tables=tables,
            seq_lens=buf.meta[:rows],
            context_lens=buf.meta[rows:2 * rows],
            query_start_loc=buf.meta[2 * rows:3 * rows + 1],
            max_query_len=0 if decode else q,
            max_decode_seq_len=cap if decode else 0,
            max_seq_len=cap,
            sliding_window=buf.sliding_window,
            decode_num_splits=None,
        )

    def advance_graph_buffers(self, buf: TritonGraphBuffers, rows: int) -> None:
        """Live rows (seq_len > 0) one token on: lengths + 1, the slot of the new position
        (= the new context length) from the row's table. The table column is clamped: after
        a drafter's last step it may point past the row's blocks, a slot no step uses."""
        bs = buf.block_size
        seq, ctx = buf.meta[:rows], buf.meta[rows:2 * rows]
        live = seq > 0
        step = live.to(torch.int32)
        seq.add_(step)
        ctx.add_(step)
        col = torch.clamp(ctx // bs, max=buf.block_tables.shape[1] - 1).long()
        block = buf.block_tables[:rows].gather(1, col[:, None])[:, 0].long()
        buf.slot_mapping[:rows].copy_(torch.where(live, block * bs + ctx % bs, -1))

    @staticmethod
    def _fill_tables(buf: TritonGraphBuffers, turn: int, block_tables: list[list[int]],
                     last: int | None = None) -> None:
        """last: only each row's last this-many entries are read (a sliding window's
        group), None: every entry."""
        n, width = len(block_tables), max(len(t) for t in block_tables)
        if width > buf.block_tables.shape[1]:
            raise ValueError(f"a sequence needs {width} blocks, graphs hold "
                             f"{buf.block_tables.shape[1]}")
        # Staged as a contiguous [n, width] host block (whole device rows would copy up to
        # max_blocks entries per row); the device scatters it into the wider rows. Entries
        # past a row's length are never read, nor, in a window's group, those before its
        # last `last` (ids from earlier fills: real blocks, masked out), so stale cells are
        # harmless; a window's table costs the host its window, not the whole context.
        tables = buf.host_tables[turn][:n * width].reshape(n, width)
        for i, t in enumerate(block_tables):
            a = 0 if last is None else max(len(t) - last, 0)
            tables[i, a:len(t)] = t[a:] if a else t
        buf.block_tables[:n, :width].copy_(torch.from_numpy(tables), non_blocking=True)


WINDOW_TILE_TOKENS = 128  # a margin past the window for kernel tiles (the kernels need none)


def _window_columns(buf: TritonGraphBuffers, q: int) -> int | None:
    """A window group's last entries a fill writes: its window and q tokens (None: all)."""
    if not buf.sliding_window:
        return None
    return -(-(buf.sliding_window + q + WINDOW_TILE_TOKENS) // buf.block_size) + 1
