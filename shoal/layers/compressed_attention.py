"""DeepSeek-V4's attention block, in plain torch on any device.

Shared-KV multi-query attention: the queries come from a low-rank latent (q_a_proj ->
RMSNorm -> q_b_proj, then an RMSNorm without weight per head), one KV row per token
(kv_proj -> RMSNorm) is both key and value, and RoPE rotates the trailing qk_rope_head_dim
channels of each (interleaved pairs, shoal/layers/interleaved_rope.py). A query reads, in one
softmax with a learned sink per head (a logit with no value):
- the last sliding_window tokens (every layer), from a paged sliding-window cache
  (SlidingSharedKVSpec: one row per token, its tables drop the blocks behind the window);
- on compressed layers, the entries of the complete groups of tokens it has seen: every one
  (HCA, m' = compress_rates' heavily_compressed_attention) or the indexer's top-k of them
  (CSA, m = compressed_sparse_attention; shoal/layers/compressed_indexer.py). An entry (and
  on CSA the indexer's key beside it) is computed once, by the step that closes its group,
  and kept for the whole context (PagedEntries, CompressedEntrySpec: 1/m of a row a token;
  HCA's groups, longer than a block, in sparse tables); the compressors' per-token inputs
  wait only while their group is open (and, for CSA's overlapping groups, the one after), in
  sliding tables (CompressorStateSpec). Every request's new entries are stored before any
  request reads, so a prefix hit on blocks computed in the same step reads them.
The value's rotation is undone on the output (RoPE at minus the query's position), then a
grouped output projection: o_groups blocks of heads each projected to o_lora_rank (o_a_proj),
mixed to hidden_size (o_b_proj).

Plain torch over the step (shoal/layers/request_spans.py): it runs on any device; on CUDA
(use_triton_ops, with Triton installed; compressed_attention_kernels.py) the attention and CSA's indexer scores run as Triton
kernels reading the caches directly, one query token a row, each row's loops stopping at its
own position (shoal/attention/ops/v4_decode_attention.py, v4_index_scores.py; the torch path is
their reference): the decodes, and the tokens of prefill chunks and verify steps, each at its
position over its request's tables (shoal/layers/span_rows.py), in memory and time that grow
with the tokens times what each reads (window + top-k or HCA's entries), not chunk x context. The step's decodes close their groups and attend as one batch, in shapes fixed by
their block tables' width and masked per decode (every decode computes the entry its token would
close, only those that close one store it; a CSA decode scores every entry its tables hold and
reads the indexer's top-k; the kernels skip the scores and top-k while the tables hold no more
than top-k entries, every one then read), from device tensors only: a step of decodes alone is
captured in a CUDA graph. That work follows the width: eagerly the step's longest table's, in a
graph the narrowest captured width holding it (DeepseekV4ForCausalLM.decode_table_buckets_from).
The other requests (prefill chunks, verify steps: eager, their spans read on the host) run
through the same kernels on CUDA; in the torch path one by one, their queries in chunks whose
score tensors stay under SCORE_ELEMENTS (a long prefill chunk would otherwise hold [n, H, n]
scores, and the indexer's [n, index_n_heads, n / m]).

Tensor parallelism splits the query heads, their sinks and the output groups (o_groups / tp
each: a group's heads stay on one rank, so o_a_proj splits by rows and o_b_proj by columns,
all-reduced). The one shared KV row, the compressors and the indexer are replicated: every
rank keeps the whole caches (their specs do not change with tp) and picks the same entries.

kv_cache_dtype="fp8": the window's rows and the compressed entries (CSA's with their index
keys) are stored as e4m3 with a float32 scale per block of values (attention/fp8_rows.py),
about half of bfloat16's bytes, and read back dequantized by the torch path and the decode
kernels alike; the step's own rows and entries are read as the cache gives them back, so a
prefix hit reads what a miss does. The open groups' compressor inputs stay in the model
dtype (see __init__)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shoal.attention.fp8_rows import INDEXER_KEY_BLOCK, KV_ROW_BLOCK, BlockScaledRows
from shoal.core.kv_cache_spec import CompressorStateSpec
from shoal.distributed.parallel_state import get_tp_rank, get_tp_world_size
from shoal.layers.compressed_attention_kernels import TritonRows
from shoal.layers.compressed_indexer import CompressedIndexer, SparseCompressor
from shoal.layers.interleaved_rope import InterleavedRope
from shoal.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    default_weight_loader,
)
from shoal.layers.norm import RMSNorm
from shoal.layers.ops.dispatch import use_triton
from shoal.layers.paged_entries import PagedEntries
from shoal.layers.paged_rows import PagedRows
from shoal.layers.request_spans import RequestSpan, StepSpans
from shoal.layers.token_compressor import TokenCompressor

SLIDING, CSA, HCA = ("sliding_attention", "compressed_sparse_attention",
                     "heavily_compressed_attention")
# float32 score elements one chunk of queries may hold (per tensor: the softmax keeps a few
# alive), 128 MiB: 8192 prefill queries at 64 heads would otherwise take 17 GiB for the window
SCORE_ELEMENTS = 1 << 25


def queries_per_chunk(heads: int, keys: int, grows: bool = True) -> int:
    """The most queries c (>= 1) whose scores c x heads x (keys + c) (grows: each query adds
    a key, a request's own chunk) or c x heads x keys (a batch of decodes) stay within
    SCORE_ELEMENTS."""
    budget = SCORE_ELEMENTS // max(1, heads)
    if not grows:
        return max(1, budget // max(1, keys))
    return max(1, (math.isqrt(keys * keys + 4 * budget) - keys) // 2)


class CompressedAttention(TritonRows, nn.Module):
    def __init__(self, cfg: Any, layer: int, dtype: torch.dtype, use_triton_ops: bool = True):
        super().__init__()
        self.kind = cfg.layer_types[layer]
        self.use_triton_ops = use_triton_ops  # CUDA: the decodes through Triton kernels
        if self.kind not in (SLIDING, CSA, HCA):
            raise ValueError(f"unknown DeepSeek-V4 layer type {self.kind!r}")
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        heads, groups, tp = cfg.num_attention_heads, cfg.o_groups, get_tp_world_size()
        self.head_dim, self.window, self.eps = cfg.head_dim, cfg.sliding_window, eps
        heads_dim = heads * self.head_dim
        if heads_dim % groups:
            raise ValueError(f"o_groups ({groups}) must divide the heads' {heads_dim} channels")
        for name, n in (("num_attention_heads", heads), ("o_groups", groups)):
            if n % tp:
                raise ValueError(f"DeepSeek-V4: {name} ({n}) must be a multiple of "
                                 f"tensor_parallel_size ({tp})")
        # this rank's heads and output groups
        self.num_heads, self.o_groups, self.o_rank = heads // tp, groups // tp, cfg.o_lora_rank
        self.scale = self.head_dim ** -0.5
        self.rope = InterleavedRope(cfg, "main" if self.kind == SLIDING else "compress")
        self.q_a_proj = ReplicatedLinear(h, cfg.q_lora_rank, params_dtype=dtype)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, eps, dtype, use_triton_ops)
        self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, heads_dim, params_dtype=dtype)
        self.kv_proj = ReplicatedLinear(h, self.head_dim, params_dtype=dtype)
        self.kv_norm = RMSNorm(self.head_dim, eps, dtype, use_triton_ops)
        # rows: the groups' blocks of o_lora_rank, this rank's groups
        self.o_a_proj = ColumnParallelLinear(heads_dim // groups, groups * self.o_rank,
                                             params_dtype=dtype)
        self.o_a_proj.weight_only = True  # read per group (_grouped_out), never run as a layer
        self.o_b_proj = RowParallelLinear(groups * self.o_rank, h, params_dtype=dtype)
        # float32, as transformers keeps them; this rank's heads'
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32),
                                  requires_grad=False)
        self.sinks.weight_loader = self._load_sinks
        # In an FP8 pool (kv_cache_dtype="fp8") the window's rows and the entries (with CSA's
        # index keys) are block-scaled FP8 (attention/fp8_rows.py); the open groups' inputs
        # keep the model dtype: their gate half are softmax logits, which FP8's 1/16 steps
        # would move by several percent of a weight, and they are a few rows a request.
        self.window_rows = PagedRows(self.head_dim, self.window,
                                     fp8=BlockScaledRows.of((self.head_dim, KV_ROW_BLOCK)))
        self.compressor: TokenCompressor | None = None
        self.indexer: CompressedIndexer | None = None
        if self.kind == CSA:
            sparse = SparseCompressor(cfg, cfg.compress_rates[CSA], self.rope, dtype,
                                      use_triton_ops)
            self.compressor, self.indexer = sparse, sparse.indexer
        elif self.kind == HCA:
            self.compressor = TokenCompressor(h, self.head_dim, cfg.compress_rates[HCA], False,
                                              eps, self.rope, dtype, use_triton_ops)
        self.entries: PagedEntries | None = None
        self.pending_rows: PagedRows | None = None
        if self.compressor is not None:
            m = self.compressor.ratio
            index_dim = self.indexer.head_dim if self.indexer is not None else 0
            fp8 = BlockScaledRows.of((self.head_dim, KV_ROW_BLOCK),
                                     (index_dim, INDEXER_KEY_BLOCK))
            self.entries = PagedEntries(self.head_dim + index_dim, m, fp8=fp8)
            self.pending_rows = PagedRows(self._row_split()[-1],
                                          (1 + self.compressor.groups_before) * m,
                                          CompressorStateSpec, dtype=dtype)

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        n = self.num_heads
        default_weight_loader(param, loaded.narrow(0, get_tp_rank() * n, n))

    def paged_layers(self) -> list[PagedRows]:
        """Its paged caches: the sliding window's rows, then (compressed layers) the entries
        and the compressors' inputs of the open groups."""
        if self.entries is None or self.pending_rows is None:
            return [self.window_rows]
        return [self.window_rows, self.entries, self.pending_rows]

    def _row_split(self) -> tuple[int, int]:
        """(the compressor's row width, the whole compressed row's: + the indexer's)."""
        assert self.compressor is not None
        width = self.compressor.row_width
        return width, width + (self.indexer.row_width if self.indexer is not None else 0)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                step: StepSpans) -> torch.Tensor:
        t = hidden.shape[0]
        cos, sin = self.rope.cos_sin(positions)
        q_resid = self.q_a_norm(self.q_a_proj(hidden))
        q = self.q_b_proj(q_resid).view(t, self.num_heads, self.head_dim)
        q = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + self.eps).to(q.dtype)
        q = self.rope.rotate(q, cos, sin)
        kv = self.rope.rotate(self.kv_norm(self.kv_proj(hidden)), cos, sin)
        # the rows and entries as later reads give them (FP8 rounds) for the torch path of
        # the spans only: the decodes and the kernels read them from the caches
        torch_spans = self._spans_in_torch(q, step)
        ctx = _StepInputs(q, self.window_rows.write(kv, step, want_rows=torch_spans))
        nd = step.num_decodes  # the leading rows, attended as one batch
        if self.compressor is not None:
            rows = self.compressor.project(hidden)
            if self.indexer is not None:
                rows = torch.cat([rows, self.indexer.project(hidden)], dim=-1)
                ctx.index_q, ctx.index_w = self.indexer.queries(hidden, q_resid, cos, sin)
            self.pending_rows.write(rows, step, want_rows=False)
            ctx.rows = rows
            # every request's closed groups are stored before any request reads entries (the
            # decodes' as one batch: they read theirs back from the cache)
            if nd:
                self._close_decode_groups(step)
            ctx.new_entries = [self._close_groups(rows, step, span, torch_spans)
                               for span in step.spans]
        out = self.rope.rotate(self._attend_step(ctx, step), cos, sin, inverse=True)
        return self.o_b_proj(self._grouped_out(out.view(t, self.o_groups, -1)))

    def _attend_step(self, ctx: _StepInputs, step: StepSpans) -> torch.Tensor:
        """Every query of the step [T, H, D] over what it sees (the step's rows and entries
        already stored): the decodes as one batch, then the other requests' tokens (on CUDA
        as rows of the same kernels, else request by request in torch)."""
        if step.decodes_only:  # (what a decode graph captures)
            return self._attend_decodes(ctx, step)
        nd = step.num_decodes
        out = torch.empty_like(ctx.q)
        if nd:
            out[:nd] = self._attend_decodes(ctx, step)
        if not step.spans:
            return out
        if self._spans_in_torch(ctx.q, step):
            spans = self._attend_spans(ctx, step)
        else:
            spans = self._attend_spans_triton(ctx, step)
        out[nd:nd + spans.shape[0]] = spans
        return out

    def _spans_in_torch(self, q: torch.Tensor, step: StepSpans) -> bool:
        """Whether the step's prefill chunks and verify steps (if any) run the torch path
        (_attend_spans), which reads the step's own rows and entries as write and store give
        them back; else the kernels (or a step of decodes alone) read every row from the
        caches. A pooling step, which caches nothing, reads its own rows: torch."""
        return bool(step.spans) and not (step.slots and use_triton(q, self.use_triton_ops))

    def _attend_spans(self, ctx: _StepInputs, step: StepSpans) -> torch.Tensor:
        """The torch path of the step's prefill chunks and verify steps [n, H, D] (the flat
        rows after the decodes, span after span), request by request."""
        outs = [self._attend(ctx, step, span, i) for i, span in enumerate(step.spans)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _grouped_out(self, x: torch.Tensor) -> torch.Tensor:
        """[T, g, in] -> [T, g * o_lora_rank]: each group of heads through its own block of
        o_a_proj."""
        w = self.o_a_proj.weight.view(self.o_groups, self.o_rank, -1)
        y = torch.bmm(x.transpose(0, 1), w.transpose(1, 2))  # [g, T, o]
        return y.transpose(0, 1).reshape(x.shape[0], -1)

    def _close_groups(self, rows: torch.Tensor, step: StepSpans, span: RequestSpan,
                      want_rows: bool = True) -> torch.Tensor | None:
        """The entries [k, D (+ index_head_dim)] of the request's groups that close in this
        step, stored in its pages (None: none closes, or want_rows is False: only stored)."""
        assert self.compressor is not None and self.entries is not None
        m = self.compressor.ratio
        first, end = span.context // m, span.end // m
        if end == first:
            return None
        lo = max(0, first - self.compressor.groups_before)
        inputs = self.pending_rows.read(rows, step, span, lo * m, end * m)
        width, _ = self._row_split()
        entries = self.compressor.compress(inputs[:, :width], lo)
        if self.indexer is not None:
            keys = self.indexer.compress(inputs[:, width:], lo)
            entries = torch.cat([entries, keys.to(entries.dtype)], dim=-1)
        return self.entries.store(entries[first - lo:], first, step, span, want_rows=want_rows)

    @property
    def _score_heads(self) -> int:
        """Heads of the widest score tensor a query makes (its own, or the indexer's)."""
        return max(self.num_heads, self.indexer.n_heads if self.indexer is not None else 0)

    def _attend_decodes(self, ctx: _StepInputs, step: StepSpans) -> torch.Tensor:
        """The step's decodes [Bd, H, D] as one batch, each query over its window's rows and
        its compressed entries, read from the caches (this step's were written before). The
        shapes follow the tables' width, never a decode's length: a graph replays them."""
        if use_triton(ctx.q, self.use_triton_ops):
            return self._attend_decodes_triton(ctx, step)
        nd, n_entries = step.num_decodes, 0
        if self.entries is not None:
            index = self.entries.decode_index(step)
            n_entries = 0 if index is None else index[2].shape[1]
        per = queries_per_chunk(self._score_heads, self.window + n_entries, grows=False)
        outs = [self._attend_decode_rows(ctx, step, slice(a, min(a + per, nd)))
                for a in range(0, nd, per)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend_decode_rows(self, ctx: _StepInputs, step: StepSpans,
                            rows: slice) -> torch.Tensor:
        q = ctx.q[rows]
        keys, allowed = self.window_rows.read_decodes(step, self.window, rows, q.dtype)
        entries = self._decode_entries(ctx, step, rows) if self.entries is not None else None
        if entries is not None:
            stored, own = entries
            keys = torch.cat([keys, stored], dim=1)
            allowed = torch.cat([allowed, own], dim=1)
        return self._softmax(q, keys, allowed)

    def _decode_entries(self, ctx: _StepInputs, step: StepSpans, rows: slice
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The entries the decodes `rows` read [n, K, D] and which are theirs to read [n, K]:
        on HCA every entry their tables hold, on CSA the indexer's top-k of them (scored on
        their index keys; only the picked ones' keys are read). None: the tables hold none."""
        assert self.entries is not None
        d, dtype = self.head_dim, ctx.q.dtype
        if self.indexer is None:
            return self.entries.load_decodes(step, rows, slice(0, d), dtype)
        loaded = self.entries.load_decodes(step, rows, slice(d, None), torch.float32)
        if loaded is None:
            return None
        index_keys, own = loaded
        picked, seen = self.indexer.pick(ctx.index_q[rows], ctx.index_w[rows], index_keys, own)
        return self.entries.gather_decodes(step, rows, picked, slice(0, d), dtype), seen

    def _close_decode_groups(self, step: StepSpans) -> None:
        """The entries of the groups the step's decodes complete (a decode closes at most
        one), computed as one batch from the open groups' rows in the cache and stored. Every
        decode row computes one (fixed shapes); only those closing a group store theirs."""
        assert self.compressor is not None and self.entries is not None
        closing, groups, slots = self._closing_decodes(step)
        inputs = self.pending_rows.rows_at(slots)
        width, _ = self._row_split()
        entries = self.compressor.compress_closing(inputs[..., :width], groups)
        if self.indexer is not None:
            keys = self.indexer.compress_closing(inputs[..., width:], groups)
            entries = torch.cat([entries, keys.to(entries.dtype)], dim=-1)
        self.entries.store_decodes(entries, closing, groups, step)

    def _closing_decodes(self, step: StepSpans
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For each of the step's decodes: whether its token completes a group [Bd] (never a
        graph's padding row), that group [Bd] (0 before the first completes) and the slots of
        the rows its entry pools [Bd, (1 + groups_before) m] (a group 0's missing group
        before reads position 0's, masked). Built once per step and ratio."""
        assert self.compressor is not None and self.pending_rows is not None
        m, before = self.compressor.ratio, self.compressor.groups_before
        group = self.pending_rows.kv_group
        key = ("closing", group, m, before)
        if key not in step.indices:
            p = step.decode_positions
            closing = (torch.remainder(p + 1, m) == 0) & step.decode_live(group)
            groups = (torch.div(p + 1, m, rounding_mode="floor") - 1).clamp(min=0)
            k = (groups - before)[:, None] * m + torch.arange((1 + before) * m,
                                                              device=p.device)
            k = k.clamp(min=0)
            bs = step.block_size
            table = step.decode_tables[group]
            # (a decode closing nothing may point past its blocks: a column of its table)
            column = (k // bs).clamp(max=table.shape[1] - 1)
            step.indices[key] = closing, groups, table.gather(1, column) * bs + k % bs
        return step.indices[key]

    def _attend(self, ctx: _StepInputs, step: StepSpans, span: RequestSpan,
                i: int) -> torch.Tensor:
        """One request's queries [n, H, D] over its window and its compressed entries, in
        chunks of queries (queries_per_chunk)."""
        stored = self._span_entries(ctx, step, span, i)
        keys = self.window + (0 if stored is None else len(stored))
        per = queries_per_chunk(self._score_heads, keys)
        outs = [self._attend_rows(ctx, step, span, a, min(a + per, span.length), stored)
                for a in range(0, span.length, per)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _attend_rows(self, ctx: _StepInputs, step: StepSpans, span: RequestSpan, a: int,
                     b: int, stored: torch.Tensor | None) -> torch.Tensor:
        """The request's queries [a, b) (positions context + a, ...) over their windows and
        the entries they have seen of `stored`."""
        rows = slice(span.start + a, span.start + b)
        device = ctx.q.device
        first, end = span.context + a, span.context + b
        pos = torch.arange(first, end, device=device)
        lo = max(0, first - self.window + 1)
        if ctx.kv is None:
            raise RuntimeError("the step's window rows were written without reading them back "
                               "(_spans_in_torch said the kernels run its spans)")
        keys = self.window_rows.read(ctx.kv, step, span, lo, end)
        k_pos = torch.arange(lo, end, device=device)
        allowed = (k_pos <= pos[:, None]) & (k_pos > pos[:, None] - self.window)
        if stored is not None:
            m = self.compressor.ratio
            n = min(len(stored), end // m)  # entry w pools tokens [w m, (w + 1) m)
            if n:
                # a query sees an entry once it has all of its group's tokens
                visible = torch.arange(n, device=device) < ((pos + 1) // m)[:, None]
                if self.indexer is not None:
                    visible = self.indexer.select(ctx.index_q[rows], ctx.index_w[rows],
                                                  stored[:n, self.head_dim:], visible)
                keys = torch.cat([keys, stored[:n, :self.head_dim]])
                allowed = torch.cat([allowed, visible], dim=-1)
        return self._softmax(ctx.q[rows], keys, allowed)

    def _softmax(self, q: torch.Tensor, keys: torch.Tensor,
                 allowed: torch.Tensor) -> torch.Tensor:
        """q [n, H, D] over keys [K, D] (or each query's own, [n, K, D]) where allowed [n, K]:
        one softmax with each head's sink (a logit with no value), the keys as values."""
        scores = torch.matmul(q, keys.transpose(-1, -2)).float() * self.scale  # [n, H, K]
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
        sinks = self.sinks.float().view(1, -1, 1).expand(q.shape[0], -1, 1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        probs = logits.softmax(dim=-1)[..., :-1]
        return torch.matmul(probs.to(keys.dtype), keys)

    def _span_entries(self, ctx: _StepInputs, step: StepSpans, span: RequestSpan,
                      i: int) -> torch.Tensor | None:
        """The request's entries [N, D (+ index_head_dim)] of its complete groups (N =
        span.end // m): those cached before this step, then those it closes (None: a sliding
        layer, or no complete group yet). i: its index in step.spans."""
        if self.compressor is None or self.entries is None:
            return None
        m = self.compressor.ratio
        n, cached = span.end // m, span.context // m
        if not n:
            return None
        parts = [self.entries.load(step, span, cached, ctx.q.dtype)] if cached else []
        if ctx.new_entries[i] is not None:
            parts.append(ctx.new_entries[i])
        return torch.cat(parts) if len(parts) > 1 else parts[0]


@dataclass
class _StepInputs:
    """What every request of the step reads: queries, KV rows, and on compressed layers the
    compressors' rows, the entries each of step.spans closes in this step, and the indexer's
    queries and head weights."""

    q: torch.Tensor
    kv: torch.Tensor | None  # (None where only the caches are read: see _spans_in_torch)
    rows: torch.Tensor | None = None
    new_entries: list[torch.Tensor | None] | None = None
    index_q: torch.Tensor | None = None
    index_w: torch.Tensor | None = None
