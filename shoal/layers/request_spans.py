"""A step's requests as spans of the flattened tokens, with each one's cached context and
block tables: what layers that compute per request read (DeepSeek-V4's compressed attention,
shoal/layers/compressed_attention.py) instead of the attention backend's batched layout.

Built once per step from whatever metadata the runner hands the model: the torch backend's
AttentionMetadata or the Triton backend's TritonAttentionMetadata (one per KV cache group;
the layers read neither backend's kernels, only the requests' spans, tables and slots), or a
pooling step's PackedSeqs (whole prompts, nothing cached). The host values (each request's
start, length and context) are read back once per step, not per layer.

The step's decodes (the leading requests of one new token after their cached ones, as both
backends order them) are also kept as a batch: their positions and block tables [Bd, N] per
group on the device, so a layer attends for all of them at once; the gather indices the
layers derive from them (window slots, entry pages) are built by the first layer that needs
them and kept for the step in `indices`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.attention.metadata import AttentionMetadata, GroupedMetadata
from shoal.attention.packed import PackedSeqs


@dataclass(frozen=True)
class RequestSpan:
    """One request's new tokens: flat rows [start, start + length) at positions
    [context, context + length). tables[g]: its block table in KV cache group g (padded with
    the null block); empty where nothing cached is read (context 0) and for the step's
    decodes, which read through StepSpans.decode_tables."""

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
    pooling step, which caches nothing) and the block size. The first num_decodes spans are
    decodes (flat rows [0, num_decodes)): decode_positions [Bd] and, per group,
    decode_tables [Bd, N] (int64) hold them as a batch."""

    spans: tuple[RequestSpan, ...]
    slots: tuple[torch.Tensor, ...]
    block_size: int
    num_decodes: int = 0
    decode_positions: torch.Tensor | None = None
    decode_tables: tuple[torch.Tensor, ...] = ()
    # gather indices the layers share within the step, by (kind, group, size)
    indices: dict[tuple, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def of(cls, md: object, positions: torch.Tensor) -> StepSpans:
        if isinstance(md, PackedSeqs):
            spans, start = [], 0
            for n in md.seq_lens:
                spans.append(RequestSpan(start, n, 0, ()))
                start += n
            return cls(tuple(spans), (), 0)
        mds = md.groups if isinstance(md, GroupedMetadata) else (md,)
        if all(isinstance(m, AttentionMetadata) for m in mds):
            return cls._of_torch(mds, positions)
        from shoal.attention.triton_backend import TritonAttentionMetadata

        if all(isinstance(m, TritonAttentionMetadata) for m in mds):
            return cls._of_triton(mds, positions)
        raise TypeError(f"per-request spans need the torch or Triton backend's metadata, got "
                        f"{type(mds[0]).__name__}")

    @classmethod
    def _of_torch(cls, mds: tuple[AttentionMetadata, ...], positions: torch.Tensor
                  ) -> StepSpans:
        starts = _span_lengths(mds[0])
        tables = [_prefill_tables_by_start(m) for m in mds]
        first = sorted(starts)
        contexts = positions[torch.tensor(first, dtype=torch.long, device=positions.device)
                             ].tolist() if first else []
        nd = mds[0].num_decodes  # (flat starts [0, nd))
        spans = tuple(RequestSpan(s, starts[s], c, tuple(t[s] for t in tables) if c and s >= nd
                                  else ()) for s, c in zip(first, contexts))
        return cls(spans, tuple(m.slot_mapping for m in mds), mds[0].block_size, nd,
                   positions[:nd] if nd else None,
                   tuple(m.decode_block_tables for m in mds) if nd else ())

    @classmethod
    def _of_triton(cls, mds: tuple, positions: torch.Tensor) -> StepSpans:
        """Rows are requests in flat order (eager metadata: no padded rows); their tables
        [R, N] int32, zero past a request's blocks (never read: a span reads its own)."""
        md = mds[0]
        rows = md.num_decodes + md.num_prefills
        host = torch.cat([md.query_start_loc[:rows + 1], md.context_lens[:rows]]).tolist()
        starts, contexts = host[:rows + 1], host[rows + 1:]
        tables = [m.block_tables[:rows].long() for m in mds]
        nd = md.num_decodes
        spans = tuple(RequestSpan(starts[r], starts[r + 1] - starts[r], c,
                                  tuple(t[r] for t in tables) if c and r >= nd else ())
                      for r, c in enumerate(contexts))
        return cls(spans, tuple(m.slot_mapping for m in mds), md.block_size, nd,
                   positions[:nd] if nd else None,
                   tuple(t[:nd] for t in tables) if nd else ())


def _span_lengths(md: AttentionMetadata) -> dict[int, int]:
    """Flat start -> new tokens of every request of the step."""
    out = {i: 1 for i in range(md.num_decodes)}
    out.update(dict(md.fresh_spans))
    if md.prefill_token_index is not None:
        firsts = md.prefill_token_index[:, 0].tolist()
        out.update(zip(firsts, md.prefill_token_valid.sum(1).tolist()))
    return out


def _prefill_tables_by_start(md: AttentionMetadata) -> dict[int, torch.Tensor]:
    """Flat start -> block table of the prefill chunks that read cached rows (the masked
    ones: a fresh prompt reads none)."""
    out: dict[int, torch.Tensor] = {}
    if md.prefill_token_index is not None:
        out.update(zip(md.prefill_token_index[:, 0].tolist(),
                       md.prefill_block_tables.unbind(0)))
    return out
