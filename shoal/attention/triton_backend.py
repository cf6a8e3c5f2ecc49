"""Attention over the paged KV cache with the Triton kernels (the GPU fast path).

Same semantics as shoal.attention.torch_backend.paged_attention: write the step's keys and
values into their slots, then attend the decode rows (tokens [0, num_decode_rows), one query
each) with the decode kernel and the prefill chunks (the remaining tokens) with the prefill
kernel. One row per request in every per-request tensor, decodes first.
paged_attention_triton_fused takes q and k before their per-head RMSNorm and rotary and
applies both in the cache-write kernel: one launch where the layer made up to four.

CUDA graphs: pass pad_decodes_to (rows past num_decodes get seq_len 0, slot -1 and produce
zeros), block_table_width (fixed table width) and decode_num_splits (fixed split-K grid);
then every tensor shape and launch parameter depends on the padded sizes only. The backend
class below does this with persistent buffers for shoal.worker.cuda_graphs.DecodeGraphs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shoal.attention.backend import AttentionBackend
from shoal.attention.metadata import token_slots
from shoal.attention.ops.kv_cache_write import write_kv_cache
from shoal.attention.ops.mla_cache_write import write_mla_cache
from shoal.attention.ops.mla_decode import mla_paged_decode
from shoal.attention.ops.mla_prefill import mla_paged_prefill
from shoal.attention.ops.paged_decode import paged_decode
from shoal.attention.ops.paged_prefill import paged_prefill
from shoal.attention.ops.rope_kv_write import rope_kv_write
from shoal.attention.ops.warm import warm_latent_attention, warm_paged_attention
from shoal.host_to_device import to_device


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


def build_triton_attention_metadata(
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
) -> TritonAttentionMetadata:
    """Inputs as for build_attention_metadata. pad_decodes_to >= num_decodes pads the decode
    group with dummy rows (their query tokens must sit at flat positions [num_decodes,
    pad_decodes_to), before any prefill token); block_table_width fixes N."""
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

    def dev(vals: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(vals, dtype, device)

    return TritonAttentionMetadata(
        num_tokens=len(slots),
        slot_mapping=dev(slots, torch.long),
        block_size=block_size,
        num_decodes=num_decodes,
        num_decode_rows=pad,
        num_prefills=n_req - num_decodes,
        block_tables=dev(tables, torch.int32).view(len(tables), width),
        seq_lens=dev(rows(seq, 0), torch.int32),
        context_lens=dev(rows(context_lens, 0), torch.int32),
        query_start_loc=dev(starts, torch.int32),
        max_query_len=max(query_lens[num_decodes:], default=0),
        max_decode_seq_len=max(seq[:num_decodes], default=0),
        max_seq_len=max(seq, default=0),
        sliding_window=sliding_window,
        decode_num_splits=decode_num_splits,
    )


def paged_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           kv_cache: torch.Tensor, md: TritonAttentionMetadata,
                           scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hk, D]; kv_cache: [2, num_slots, Hk, D]. Returns [T, Hq, D]."""
    _check_tokens(q, md)
    write_kv_cache(kv_cache, k, v, md.slot_mapping)
    return _attend_cached(q, kv_cache, md, scale)


def paged_attention_triton_fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                                 q_norm_weight: torch.Tensor | None,
                                 k_norm_weight: torch.Tensor | None, eps: float,
                                 kv_cache: torch.Tensor, md: TritonAttentionMetadata,
                                 scale: float) -> torch.Tensor:
    """paged_attention_triton on q and k before their per-head RMSNorm (weights None: none)
    and neox rotary, which one kernel applies while writing the cache (see
    ops/rope_kv_write.py). q is rotated in place; k is left as it was."""
    _check_tokens(q, md)
    rope_kv_write(positions, q, k, v, cos_sin_cache, kv_cache, md.slot_mapping,
                  q_norm_weight, k_norm_weight, eps)
    return _attend_cached(q, kv_cache, md, scale)


def _check_tokens(q: torch.Tensor, md: TritonAttentionMetadata) -> None:
    if q.shape[0] != md.num_tokens:
        raise ValueError(f"q has {q.shape[0]} tokens, metadata {md.num_tokens}")


def _attend_cached(q: torch.Tensor, kv_cache: torch.Tensor, md: TritonAttentionMetadata,
                   scale: float) -> torch.Tensor:
    """Decode and prefill attention over a cache that already holds the step's keys."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    nd = md.num_decode_rows
    if nd:
        paged_decode(q[:nd], kv_cache, md.block_tables[:nd], md.seq_lens[:nd], md.block_size,
                     scale, sliding_window=md.sliding_window, num_splits=md.decode_num_splits,
                     max_seq_len=md.max_decode_seq_len, out=out[:nd])
    if md.num_prefills:
        # Whole tensors and first_row, not slices: see paged_prefill's kernel.
        paged_prefill(q, kv_cache, md.block_tables, md.seq_lens, md.query_start_loc,
                      md.max_query_len, md.block_size, scale,
                      sliding_window=md.sliding_window, out=out, first_row=nd)
    return out


def latent_attention_triton(q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                            md: TritonAttentionMetadata, scale: float,
                            v_dim: int) -> torch.Tensor:
    """MLA (AttentionBackend.forward_mla) with the Triton kernels: q [T, H, Dk], latent
    [T, Dk], kv_cache [1, slots, 1, Dk]. Same row layout as paged_attention_triton."""
    _check_tokens(q, md)
    cache = kv_cache.view(kv_cache.shape[1], kv_cache.shape[3])
    write_mla_cache(latent, cache, md.slot_mapping)
    out = torch.empty(q.shape[0], q.shape[1], v_dim, dtype=q.dtype, device=q.device)
    nd = md.num_decode_rows
    if nd:
        mla_paged_decode(q[:nd], cache, md.block_tables[:nd], md.seq_lens[:nd], md.block_size,
                         scale, v_dim, num_splits=md.decode_num_splits,
                         max_seq_len=md.max_decode_seq_len, out=out[:nd])
    if md.num_prefills:
        mla_paged_prefill(q, cache, md.block_tables, md.seq_lens, md.query_start_loc,
                          md.max_query_len, md.block_size, scale, v_dim, out=out,
                          first_row=nd)
    return out


@dataclass
class TritonGraphBuffers:
    """Persistent decode-step inputs of the captured graphs; the batch padded to B uses rows
    [0, B) of each."""

    block_size: int
    sliding_window: int | None
    slot_mapping: torch.Tensor  # [max_batch] int64
    block_tables: torch.Tensor  # [max_batch, max_blocks] int32
    # [2 * max_batch] int32: a graph of B rows reads seq_lens from [0, B) and context_lens
    # from [B, 2B), so a step's lens are one contiguous copy.
    lens: torch.Tensor
    query_start_loc: torch.Tensor  # [max_batch + 1] int32: arange, one token per row
    # Host staging (pinned on CUDA), so each step is one copy per dtype, each from a
    # contiguous host range (a strided source would be copied through a pageable temporary,
    # which can make the host wait). Two sets used in turn: step N+1 may be filled while
    # step N's copies are still queued.
    host_lens: Any = None  # 2 x numpy [2 * max_batch] int32
    host_slots: Any = None  # 2 x numpy [max_batch] int64
    host_tables: Any = None  # 2 x numpy [max_batch * max_blocks] int32, rows of the step's width
    turn: int = 0


@dataclass
class PrefillGraphBuffers:
    """Persistent inputs of the single-prefill graphs: one sequence of up to max_tokens query
    tokens; a graph of T tokens reads slot_mapping[:T] (-1 past the real ones)."""

    block_size: int
    sliding_window: int | None
    slot_mapping: torch.Tensor  # [max_tokens] int64
    block_table: torch.Tensor  # [1, max_blocks] int32
    # [4] int32: seq_len, context_len, then query_start_loc = [0, query_len]
    meta: torch.Tensor
    host_slots: Any = None  # 2 x numpy [max_tokens] int64 (in turn, as TritonGraphBuffers)
    host_meta: Any = None  # 2 x numpy [4] int32
    host_table: Any = None  # 2 x numpy [max_blocks] int32
    turn: int = 0


@dataclass
class VerifyGraphBuffers:
    """Persistent inputs of the verify-step graphs (speculative decoding): up to max_batch
    requests of exactly q query tokens each (the last token and q - 1 drafts); a graph of B
    requests reads rows [0, B) and tokens [0, B * q)."""

    block_size: int
    sliding_window: int | None
    q: int
    slot_mapping: torch.Tensor  # [max_batch * q] int64, -1 for padding
    block_tables: torch.Tensor  # [max_batch, max_blocks] int32
    lens: torch.Tensor  # [2 * max_batch] int32: seq_lens of B rows in [0, B), context in [B, 2B)
    query_start_loc: torch.Tensor  # [max_batch + 1] int32: arange * q
    host_lens: Any = None  # 2 x numpy [2 * max_batch] int32 (in turn, as TritonGraphBuffers)
    host_slots: Any = None  # 2 x numpy [max_batch * q] int64
    host_tables: Any = None  # 2 x numpy [max_batch * max_blocks] int32
    turn: int = 0


class TritonAttentionBackend(AttentionBackend):
    """The AttentionBackend interface in full: fused rotary + cache write, decode and
    single-prefill CUDA graphs."""

    name = "triton"
    supports_cuda_graphs = True
    supports_prefill_graphs = True
    supports_mla = True
    supports_verify_graphs = True
    supports_draft_graphs = True

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

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, md: TritonAttentionMetadata,
                scale: float) -> torch.Tensor:
        return paged_attention_triton(q, k, v, kv_cache, md, scale)

    def forward_fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
                      eps: float, kv_cache: torch.Tensor, md: TritonAttentionMetadata,
                      scale: float) -> torch.Tensor:
        """forward on q and k before their optional per-head RMSNorm and rotary (see
        paged_attention_triton_fused); only while fuses_rope_and_cache_write."""
        return paged_attention_triton_fused(q, k, v, positions, cos_sin_cache, q_norm_weight,
                                            k_norm_weight, eps, kv_cache, md, scale)

    def forward_mla(self, q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                    md: TritonAttentionMetadata, scale: float, v_dim: int) -> torch.Tensor:
        return latent_attention_triton(q, latent, kv_cache, md, scale, v_dim)

    def warm_kernels(self, kv_cache: torch.Tensor, num_heads: int, scale: float,
                     block_size: int, sliding_window: int | None) -> int:
        return warm_paged_attention(kv_cache, num_heads, scale, block_size, sliding_window)

    def warm_mla_kernels(self, kv_cache: torch.Tensor, num_heads: int, scale: float,
                         block_size: int, v_dim: int) -> int:
        return warm_latent_attention(kv_cache, num_heads, scale, block_size, v_dim)

    def alloc_graph_buffers(self, max_batch: int, max_blocks: int, device: torch.device, *,
                            block_size: int, sliding_window: int | None) -> TritonGraphBuffers:
        pin = device.type == "cuda"

        def host(shape: tuple[int, ...], dtype: torch.dtype) -> Any:
            return torch.zeros(shape, dtype=dtype, pin_memory=pin).numpy()

        return TritonGraphBuffers(
            block_size=block_size,
            sliding_window=sliding_window,
            slot_mapping=torch.full((max_batch,), -1, dtype=torch.long, device=device),
            block_tables=torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device),
            lens=torch.zeros(2 * max_batch, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(max_batch + 1, dtype=torch.int32, device=device),
            host_lens=[host((2 * max_batch,), torch.int32) for _ in range(2)],
            host_slots=[host((max_batch,), torch.long) for _ in range(2)],
            host_tables=[host((max_batch * max_blocks,), torch.int32) for _ in range(2)],
        )

    def fill_graph_buffers(self, buf: TritonGraphBuffers, size: int, context_lens: list[int],
                           block_tables: list[list[int]] | None,
                           slot_mapping: list[int]) -> None:
        """Decode rows [0, n) from the lists (context_lens: tokens before the new one), rows
        [n, size) padding. block_tables None keeps the tables of the previous fill (the caller
        knows they did not change). Host staging buffers alternate between two sets: a fill must
        not come before the copies of the fill two before it have completed (async scheduling
        keeps at most one step in flight, so they have)."""
        n = len(context_lens)
        if n > size or size > buf.slot_mapping.shape[0]:
            raise ValueError(f"{n} decodes do not fit a graph of {size} rows")
        # Host staging in turns (see TritonGraphBuffers.turn).
        turn = buf.turn
        buf.turn ^= 1
        lens, slots = buf.host_lens[turn][:2 * size], buf.host_slots[turn][:size]
        lens[:] = 0
        lens[size:size + n] = context_lens  # layout: see TritonGraphBuffers.lens
        lens[:n] = lens[size:size + n] + 1
        slots[:n] = slot_mapping
        slots[n:] = -1
        buf.lens[:2 * size].copy_(torch.from_numpy(lens), non_blocking=True)
        buf.slot_mapping[:size].copy_(torch.from_numpy(slots), non_blocking=True)
        if block_tables is not None and n:
            self._fill_tables(buf, turn, block_tables)

    def advance_graph_buffers(self, buf: TritonGraphBuffers, size: int) -> None:
        """Live rows (seq_len > 0) one token on: lengths + 1, the slot of the new position
        (= the new context length) from the row's table. The table column is clamped: after
        a drafter's last step it may point past the row's blocks, a slot no step uses."""
        bs = buf.block_size
        seq, ctx = buf.lens[:size], buf.lens[size:2 * size]
        live = seq > 0
        step = live.to(torch.int32)
        seq.add_(step)
        ctx.add_(step)
        col = torch.clamp(ctx // bs, max=buf.block_tables.shape[1] - 1).long()
        block = buf.block_tables[:size].gather(1, col[:, None])[:, 0].long()
        buf.slot_mapping[:size].copy_(torch.where(live, block * bs + ctx % bs, -1))

    @staticmethod
    def _fill_tables(buf: TritonGraphBuffers, turn: int,
                     block_tables: list[list[int]]) -> None:
        n, width = len(block_tables), max(len(t) for t in block_tables)
        if width > buf.block_tables.shape[1]:
            raise ValueError(f"a sequence needs {width} blocks, graphs hold "
                             f"{buf.block_tables.shape[1]}")
        # Staged as a contiguous [n, width] host block (whole device rows would copy up to
        # max_blocks entries per row); the device scatters it into the wider rows. Entries
        # past a row's length are never read, so stale cells are harmless.
        tables = buf.host_tables[turn][:n * width].reshape(n, width)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = t
        buf.block_tables[:n, :width].copy_(torch.from_numpy(tables), non_blocking=True)

    def alloc_prefill_graph_buffers(self, max_tokens: int, max_blocks: int,
                                    device: torch.device, *, block_size: int,
                                    sliding_window: int | None) -> PrefillGraphBuffers:
        pin = device.type == "cuda"

        def host(shape: tuple[int, ...], dtype: torch.dtype) -> Any:
            return [torch.zeros(shape, dtype=dtype, pin_memory=pin).numpy() for _ in range(2)]

        return PrefillGraphBuffers(
            block_size=block_size,
            sliding_window=sliding_window,
            slot_mapping=torch.full((max_tokens,), -1, dtype=torch.long, device=device),
            block_table=torch.zeros(1, max_blocks, dtype=torch.int32, device=device),
            meta=torch.zeros(4, dtype=torch.int32, device=device),
            host_slots=host((max_tokens,), torch.long),
            host_meta=host((4,), torch.int32),
            host_table=host((max_blocks,), torch.int32),
        )

    def fill_prefill_graph_buffers(self, buf: PrefillGraphBuffers, size: int, context_len: int,
                                   block_table: list[int], slot_mapping: list[int]) -> None:
        """One prefill chunk of len(slot_mapping) <= size tokens after context_len cached
        ones; the rest of the graph's rows are padding (slot -1: nothing written)."""
        n = len(slot_mapping)
        if n > size or size > buf.slot_mapping.shape[0]:
            raise ValueError(f"{n} tokens do not fit a prefill graph of {size}")
        if len(block_table) > buf.block_table.shape[1]:
            raise ValueError(f"a sequence needs {len(block_table)} blocks, graphs hold "
                             f"{buf.block_table.shape[1]}")
        turn = buf.turn
        buf.turn ^= 1
        slots, meta, table = buf.host_slots[turn], buf.host_meta[turn], buf.host_table[turn]
        slots[:n] = slot_mapping
        slots[n:size] = -1
        meta[:] = (context_len + n, context_len, 0, n)
        table[:len(block_table)] = block_table
        buf.slot_mapping[:size].copy_(torch.from_numpy(slots[:size]), non_blocking=True)
        buf.meta.copy_(torch.from_numpy(meta), non_blocking=True)
        if block_table:
            buf.block_table[0, :len(block_table)].copy_(
                torch.from_numpy(table[:len(block_table)]), non_blocking=True)

    def prefill_graph_metadata(self, buf: PrefillGraphBuffers,
                               size: int) -> TritonAttentionMetadata:
        """Metadata for a graph of `size` tokens of one prefill sequence; max_query_len = size
        bounds the real chunk, whose length the kernel reads from query_start_loc."""
        cap = buf.block_table.shape[1] * buf.block_size
        return TritonAttentionMetadata(
            num_tokens=size,
            slot_mapping=buf.slot_mapping[:size],
            block_size=buf.block_size,
            num_decodes=0,
            num_decode_rows=0,
            num_prefills=1,
            block_tables=buf.block_table,
            seq_lens=buf.meta[0:1],
            context_lens=buf.meta[1:2],
            query_start_loc=buf.meta[2:4],
            max_query_len=size,
            max_decode_seq_len=0,
            max_seq_len=cap,
            sliding_window=buf.sliding_window,
            decode_num_splits=None,
        )

    def alloc_verify_graph_buffers(self, max_batch: int, q: int, max_blocks: int,
                                   device: torch.device, *, block_size: int,
                                   sliding_window: int | None) -> VerifyGraphBuffers:
        pin = device.type == "cuda"

        def host(shape: tuple[int, ...], dtype: torch.dtype) -> Any:
            return [torch.zeros(shape, dtype=dtype, pin_memory=pin).numpy() for _ in range(2)]

        return VerifyGraphBuffers(
            block_size=block_size, sliding_window=sliding_window, q=q,
            slot_mapping=torch.full((max_batch * q,), -1, dtype=torch.long, device=device),
            block_tables=torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=device),
            lens=torch.zeros(2 * max_batch, dtype=torch.int32, device=device),
            query_start_loc=torch.arange(0, (max_batch + 1) * q, q, dtype=torch.int32,
                                         device=device),
            host_lens=host((2 * max_batch,), torch.int32),
            host_slots=host((max_batch * q,), torch.long),
            host_tables=host((max_batch * max_blocks,), torch.int32),
        )

    def fill_verify_graph_buffers(self, buf: VerifyGraphBuffers, size: int,
                                  context_lens: list[int], block_tables: list[list[int]],
                                  slot_mapping: list[int]) -> None:
        """len(context_lens) <= size requests of q tokens each after their context_lens[i]
        cached ones. Padding rows get q tokens at positions [0, q) over block-table row
        entries left from earlier fills (finite cache values) and write nothing (slot -1):
        their outputs are never read."""
        n, q = len(context_lens), buf.q
        if n > size or len(slot_mapping) != n * q:
            raise ValueError(f"{n} requests of {q} tokens do not fit a verify graph of {size}")
        turn = buf.turn
        buf.turn ^= 1
        lens, slots = buf.host_lens[turn][:2 * size], buf.host_slots[turn][:size * q]
        lens[:] = 0
        lens[size:size + n] = context_lens
        lens[:size] = lens[size:2 * size] + q
        slots[:n * q] = slot_mapping
        slots[n * q:] = -1
        buf.lens[:2 * size].copy_(torch.from_numpy(lens), non_blocking=True)
        buf.slot_mapping[:size * q].copy_(torch.from_numpy(slots), non_blocking=True)
        if n:
            self._fill_tables(buf, turn, block_tables)  # type: ignore[arg-type]

    def verify_graph_metadata(self, buf: VerifyGraphBuffers,
                              size: int) -> TritonAttentionMetadata:
        """Metadata for a verify graph of `size` requests: every request is a q-token chunk
        (the prefill kernel's path), none a one-token decode."""
        cap = buf.block_tables.shape[1] * buf.block_size
        return TritonAttentionMetadata(
            num_tokens=size * buf.q,
            slot_mapping=buf.slot_mapping[:size * buf.q],
            block_size=buf.block_size,
            num_decodes=0,
            num_decode_rows=0,
            num_prefills=size,
            block_tables=buf.block_tables[:size],
            seq_lens=buf.lens[:size],
            context_lens=buf.lens[size:2 * size],
            query_start_loc=buf.query_start_loc[:size + 1],
            max_query_len=buf.q,
            max_decode_seq_len=0,
            max_seq_len=cap,
            sliding_window=buf.sliding_window,
            decode_num_splits=None,
        )

    def graph_metadata(self, buf: TritonGraphBuffers, size: int) -> TritonAttentionMetadata:
        """Metadata over views of the buffers for a graph of `size` decode rows. Its host-side
        values depend on `size` only: the split count comes from the table capacity."""
        cap = buf.block_tables.shape[1] * buf.block_size
        return TritonAttentionMetadata(
            num_tokens=size,
            slot_mapping=buf.slot_mapping[:size],
            block_size=buf.block_size,
            num_decodes=size,
            num_decode_rows=size,
            num_prefills=0,
            block_tables=buf.block_tables[:size],
            seq_lens=buf.lens[:size],
            context_lens=buf.lens[size:2 * size],
            query_start_loc=buf.query_start_loc[:size + 1],
            max_query_len=0,
            max_decode_seq_len=cap,
            max_seq_len=cap,
            sliding_window=buf.sliding_window,
            decode_num_splits=None,
        )
