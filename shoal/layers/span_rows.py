"""A step's prefill chunks and verify steps (StepSpans.spans, shoal/layers/request_spans.py) as
rows of DeepSeek-V4's row kernels (shoal/attention/ops/v4_decode_attention.py,
v4_index_scores.py): every token is a row at its own position, reading its request's row of
tables [P, N] (one row per span, so a chunk's tokens share it: no table copied per token).

The tables are the spans' own where they read cached tokens (RequestSpan.tables); a fresh
prompt's span carries none (the torch backend builds none for a full-attention group), so its
blocks come from the slots its tokens write: any token of a block names the block. Built once
per step (the positions) and per KV cache group (the tables), kept in StepSpans.indices like
the decodes' gather indices, and only for eager steps: they read the spans on the host."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.host_to_device import tensor_to_device, to_device
from shoal.layers.request_spans import StepSpans


@dataclass(frozen=True)
class SpanRows:
    """The spans' tokens, flat rows [first, first + n) of the step (right after its decodes):
    each one's position [n] int64 and its span's row of the span tables [n] int32."""

    first: int
    positions: torch.Tensor
    table_rows: torch.Tensor

    @property
    def count(self) -> int:
        return self.positions.shape[0]


def span_rows(step: StepSpans, device: torch.device) -> SpanRows:
    """The step's span tokens as rows (they must follow one another from the decodes on, as
    both backends lay them out)."""
    key = ("span_rows",)
    if key not in step.indices:
        spans = step.spans
        if not spans:
            raise ValueError("a step without prefill chunks or verify steps has no span rows")
        flat = step.num_decodes
        for s in spans:
            if s.start != flat:
                raise RuntimeError(f"span rows must follow one another after the decodes: a "
                                   f"span starts at row {s.start}, expected {flat}")
            flat += s.length
        lengths = torch.tensor([s.length for s in spans])
        index = torch.arange(len(spans), dtype=torch.int64).repeat_interleave(lengths)
        # a token's position: its span's context + its offset in the span
        starts = torch.tensor([s.start - step.num_decodes - s.context for s in spans])
        n = int(lengths.sum())
        positions = torch.arange(n) - starts[index]
        both = tensor_to_device(torch.stack([positions, index]), device)
        step.indices[key] = SpanRows(step.num_decodes, both[0], both[1].to(torch.int32))
    return step.indices[key]


def span_tables(step: StepSpans, group: int) -> torch.Tensor:
    """Each span's block table in KV cache group `group` [P, N] int64 (N: the longest span's
    blocks once the step has run; columns past a span's own read as block 0, never read)."""
    key = ("span_tables", group)
    if key not in step.indices:
        bs, spans = step.block_size, step.spans
        slots = step.slots[group]
        width = max(-(-s.end // bs) for s in spans)
        tables = torch.zeros(len(spans), width, dtype=torch.int64, device=slots.device)
        cached = [i for i, s in enumerate(spans) if s.context]
        if cached:
            own = [spans[i].tables[group] if spans[i].tables else None for i in cached]
            for i, t in zip(cached, own):
                if t is None or t.shape[0] < -(-spans[i].end // bs):
                    raise RuntimeError("a request with cached tokens has no block table "
                                       "covering its span")
            n = min(width, min(t.shape[0] for t in own))
            rows = torch.stack([t[:n] for t in own])
            tables[to_device(cached, torch.int64, slots.device), :n] = rows.to(torch.int64)
        fresh = [(i, c, s.start + c * bs) for i, s in enumerate(spans) if not s.context
                 for c in range(-(-s.length // bs))]
        if fresh:
            at = to_device(fresh, torch.int64, slots.device).T
            tables[at[0], at[1]] = torch.div(slots[at[2]], bs, rounding_mode="floor")
        step.indices[key] = tables
    return step.indices[key]
