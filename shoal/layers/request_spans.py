"""A step's requests as spans of the flattened tokens, with each one's cached context and
block tables: what layers that compute per request read (DeepSeek-V4's compressed attention,
shoal/layers/compressed_attention.py) instead of the attention backend's batched layout.

Built once per step from whatever metadata the runner hands the model: the torch backend's
AttentionMetadata (one per KV cache group, decodes, fresh prompts and masked chunks), or a
pooling step's PackedSeqs (whole prompts, nothing cached)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.attention.metadata import AttentionMetadata, GroupedMetadata
from shoal.attention.packed import PackedSeqs


@dataclass(frozen=True)
class RequestSpan:
    """One request's new tokens: flat rows [start, start + length) at positions
    [context, context + length). tables[g]: its block table in KV cache group g (padded with
    the null block), None where nothing cached is read (context 0)."""

    start: int
    length: int
    context: int
    tables: tuple[torch.Tensor | None, ...]

    @property
    def end(self) -> int:
        """Its tokens once this step has run."""
        return self.context + self.length


@dataclass(frozen=True)
class StepSpans:
    """The step's requests in flat order, each group's slot of every token (empty for a
    pooling step, which caches nothing) and the block size."""

    spans: tuple[RequestSpan, ...]
    slots: tuple[torch.Tensor, ...]
    block_size: int

    @classmethod
    def of(cls, md: object, positions: torch.Tensor) -> StepSpans:
        if isinstance(md, PackedSeqs):
            spans, start = [], 0
            for n in md.seq_lens:
                spans.append(RequestSpan(start, n, 0, ()))
                start += n
            return cls(tuple(spans), (), 0)
        mds = md.groups if isinstance(md, GroupedMetadata) else (md,)
        if not all(isinstance(m, AttentionMetadata) for m in mds):
            raise TypeError(f"per-request spans need AttentionMetadata, got {type(mds[0])}")
        starts = _span_lengths(mds[0])
        tables = [_tables_by_start(m) for m in mds]
        first = sorted(starts)
        contexts = positions[torch.tensor(first, dtype=torch.long, device=positions.device)
                             ].tolist() if first else []
        spans = tuple(RequestSpan(s, starts[s], c, tuple(t.get(s) for t in tables) if c else ())
                      for s, c in zip(first, contexts))
        return cls(spans, tuple(m.slot_mapping for m in mds), mds[0].block_size)


def _span_lengths(md: AttentionMetadata) -> dict[int, int]:
    """Flat start -> new tokens of every request of the step."""
    out = {i: 1 for i in range(md.num_decodes)}
    out.update(dict(md.fresh_spans))
    if md.prefill_token_index is not None:
        firsts = md.prefill_token_index[:, 0].tolist()
        out.update(zip(firsts, md.prefill_token_valid.sum(1).tolist()))
    return out


def _tables_by_start(md: AttentionMetadata) -> dict[int, torch.Tensor]:
    """Flat start -> block table of the requests that read cached rows (decodes and masked
    chunks; a fresh prompt reads none)."""
    out: dict[int, torch.Tensor] = {}
    if md.num_decodes:
        out.update(enumerate(md.decode_block_tables.unbind(0)))
    if md.prefill_token_index is not None:
        out.update(zip(md.prefill_token_index[:, 0].tolist(),
                       md.prefill_block_tables.unbind(0)))
    return out
