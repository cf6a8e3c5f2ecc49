"""A step's requests as the layers that compute per request read them (DeepSeek-V4's
compressed attention, shoal/layers/compressed_attention.py) instead of the attention
backend's batched layout: its decodes as one batch on the device, the other requests as spans
of the flattened tokens with each one's cached context and block tables.

Built once per step from whatever metadata the runner hands the model: the torch backend's
AttentionMetadata or the Triton backend's TritonAttentionMetadata (one per KV cache group;
the layers read neither backend's kernels, only the requests' tables and slots), or a pooling
step's PackedSeqs (whole prompts, nothing cached).

The decodes (the leading requests of one new token after their cached ones, as both backends
order them) are read from device tensors only: their positions, block tables [Bd, N] per
group and slots, so a step of decodes alone reads nothing on the host and a CUDA graph
captures it (the Triton backend's graph metadata: rows padded to the captured size, slot -1
on a padding row, tables of the graphs' fixed width). What the layers derive from them (how
many entries a decode has, which ones close a group, window slots) comes from those tensors
in shapes fixed by the table width, masked per row; the gather indices are built by the first
layer that needs them and kept for the step in `indices`. The other requests (prefill chunks,
verify steps: eager) have their starts, lengths and contexts read back once per step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from shoal.attention.metadata import AttentionMetadata, GroupedMetadata
from shoal.attention.packed import PackedSeqs


@dataclass(frozen=True)
class RequestSpan:
    """One request's new tokens after the step's decodes: flat rows [start, start + length) at
    positions [context, context + length). tables[g]: its block table in KV cache group g
    (padded with the null block); empty where nothing cached is read (context 0)."""

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
    """The step's decodes and other requests, each group's slot of every token (-1: a graph's
    padding row, which writes nothing; empty for a pooling step, which caches nothing) and the
    block size. Decodes are flat rows [0, num_decodes) (a graph's padding rows included):
    decode_positions [Bd] and, per group, decode_tables [Bd, N] (int64) hold them as a batch;
    `spans` are the requests after them, in flat order."""

    spans: tuple[RequestSpan, ...]
    slots: tuple[torch.Tensor, ...]
    block_size: int
    num_decodes: int = 0
    decode_positions: torch.Tensor | None = None
    decode_tables: tuple[torch.Tensor, ...] = ()
    # gather indices the layers share within the step, by (kind, group, size)
    indices: dict[tuple, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def decodes_only(self) -> bool:
        """A step of decodes alone (what a decode graph replays): its rows may be padding."""
        return self.num_decodes > 0 and not self.spans

    def decode_live(self, group: int) -> torch.Tensor:
        """[Bd] bool: the decode rows that are requests (a graph's padding rows have slot -1)."""
        return self.slots[group][:self.num_decodes] >= 0

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
        nd = mds[0].num_decodes  # (flat starts [0, nd))
        spans: tuple[RequestSpan, ...] = ()
        if mds[0].num_prefills:
            lengths = _prefill_lengths(mds[0])
            tables = [_prefill_tables_by_start(m) for m in mds]
            first = sorted(lengths)
            contexts = positions[torch.tensor(first, dtype=torch.long, device=positions.device)
                                 ].tolist()
            spans = tuple(RequestSpan(s, lengths[s], c, tuple(t[s] for t in tables) if c
                                      else ()) for s, c in zip(first, contexts))
        return cls(spans, tuple(m.slot_mapping for m in mds), mds[0].block_size, nd,
                   positions[:nd] if nd else None,
                   tuple(m.decode_block_tables for m in mds) if nd else ())

    @classmethod
    def _of_triton(cls, mds: tuple, positions: torch.Tensor) -> StepSpans:
        """Decode rows [0, num_decode_rows) (padding included) from the device; the prefill
        rows after them read back (eager metadata: no padded prefill rows). Tables [R, N]
        int32, zero past a request's blocks (a decode masks what it reads there). The
        decodes' work follows their tables' width: beside prefills (an eager step, read back
        anyway) it is cut to the longest decode's blocks, not the longest prefill's."""
        md = mds[0]
        nd, rows = md.num_decode_rows, md.num_decode_rows + md.num_prefills
        spans: tuple[RequestSpan, ...] = ()
        width = md.block_tables.shape[1]
        if md.num_prefills:
            longest = md.seq_lens[:nd].amax(0, keepdim=True) if nd else md.seq_lens[:0]
            host = torch.cat([md.query_start_loc[nd:rows + 1], md.context_lens[nd:rows],
                              longest]).tolist()
            p = md.num_prefills
            starts, contexts = host[:p + 1], host[p + 1:2 * p + 1]
            if nd:
                width = min(width, -(-host[2 * p + 1] // md.block_size))
            tables = [m.block_tables[nd:rows].long() for m in mds]
            spans = tuple(RequestSpan(starts[r], starts[r + 1] - starts[r], c,
                                      tuple(t[r] for t in tables) if c else ())
                          for r, c in enumerate(contexts))
        return cls(spans, tuple(m.slot_mapping for m in mds), md.block_size, nd,
                   positions[:nd] if nd else None,
                   tuple(m.block_tables[:nd, :width].long() for m in mds) if nd else ())


def _prefill_lengths(md: AttentionMetadata) -> dict[int, int]:
    """Flat start -> new tokens of every request after the decodes."""
    out = dict(md.fresh_spans)
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
