"""CompressedAttention's rows through DeepSeek-V4's Triton kernels (CUDA, use_triton_ops): the
step's decodes, and the tokens of its prefill chunks and verify steps, each a row at its own
position reading the caches directly (shoal/attention/ops/v4_decode_attention.py, and CSA's
indexer scores in v4_index_scores.py). The torch path in compressed_attention.py is their
reference; the layer picks between them."""

from __future__ import annotations

from typing import Any

import torch

from shoal.layers.request_spans import StepSpans
from shoal.layers.score_pieces import RowRun
from shoal.layers.span_rows import span_rows


class TritonRows:
    """A mixin of CompressedAttention (its window_rows, entries, indexer, sinks, scale, window
    and head_dim): its attention in the Triton kernels. ctx: the layer's _StepInputs (Any here:
    naming it would import compressed_attention back)."""

    def _attend_decodes_triton(self, ctx: Any, step: StepSpans) -> torch.Tensor:
        """_attend_decodes in Triton kernels: the indexer's scores (CSA whose tables hold more
        entries than top-k; else every entry is read, as its top-k would pick them all)
        feeding torch.topk over the tables' width, then the attention, each row's loops up to
        its own window and entries (read on the device: graph-safe)."""
        from shoal.attention.ops.v4_decode_attention import (
            DecodeEntries,
            PagedKeys,
            v4_decode_attention,
        )

        nd, bs, positions = step.num_decodes, step.block_size, step.decode_positions
        window = PagedKeys(*self.window_rows.decode_pages(step))
        entries = None
        paged = self.entries.decode_pages(step) if self.entries is not None else None
        if paged is not None:  # (else a sliding layer, or tables holding no entry)
            pages, picked = PagedKeys(*paged), None
            if self.indexer is not None:
                picked = self.indexer.pick_rows(ctx.index_q[:nd], ctx.index_w[:nd],
                                                positions, pages, self.head_dim, bs)
            entries = DecodeEntries(pages, self.entries.ratio, picked)
        return v4_decode_attention(ctx.q[:nd], positions, self.sinks, self.scale, window,
                                   self.window, bs, entries)

    def _attend_spans_triton(self, ctx: Any, step: StepSpans) -> torch.Tensor:
        """The step's prefill chunks and verify steps [n, H, D] in the decode kernels: each
        token a row at its own position over its request's tables (shoal/layers/span_rows.py),
        reading its window up to itself and its picked (CSA) or every (HCA) entry of the
        groups complete at its position, from the caches: this step's rows and the entries of
        the groups it closes are stored before (forward), so a token reads what the torch path
        (_attend) gives it, a decode at its position alike."""
        from shoal.attention.ops.v4_decode_attention import (
            DecodeEntries,
            PagedKeys,
            v4_decode_attention,
        )

        rows = span_rows(step, ctx.q.device)
        part = slice(rows.first, rows.first + rows.count)
        bs = step.block_size
        window = PagedKeys(*self.window_rows.span_pages(step))
        entries = None
        paged = self.entries.span_pages(step) if self.entries is not None else None
        if paged is not None:  # (else a sliding layer, or no span reaches a whole group)
            pages, picked = PagedKeys(*paged), None
            if self.indexer is not None:
                # (eager: each piece of rows scored over the columns its spans reach)
                runs = [RowRun(s.length, s.context + 1) for s in step.spans]
                picked = self.indexer.pick_rows(ctx.index_q[part], ctx.index_w[part],
                                                rows.positions, pages, self.head_dim, bs,
                                                rows.table_rows, runs)
            entries = DecodeEntries(pages, self.entries.ratio, picked)
        return v4_decode_attention(ctx.q[part], rows.positions, self.sinks, self.scale, window,
                                   self.window, bs, entries, table_rows=rows.table_rows)
