"""CUDA graphs of a hidden-state head's mirror pass and its draft 1 (speculative decoding,
mtp.py): one graph per padded shape, (requests, tokens a request).

Every sampled target step is mirrored into the head (its KV written, each drafting request's
last row giving draft 1) before the drafts the next step verifies can be read: the pass is
on every drafting step's critical path. Run eagerly it is a host's worth of launches (0.85 ms
of an H100 host's time for an 8B EAGLE-3 head's few rows at batch 1, four times the device's)
and draft 1's pick a few more. Its shape repeats: a request mirrors one row (a decode, a
verify whose drafts all failed) or up to k + 1 (a verify), so graphs of q = 1 and q = k + 1
tokens a request, requests padded to the draft graphs' sizes, serve every step whose requests
have no kept rows to catch up. A catch-up (a request's kept rows ahead of its own,
mirror_backlog.py: up to MAX_ROWS + k + 1 rows) at up to CATCH_UP_ROWS requests replays a
graph of that many tokens a request, its rows gathered from the ring of kept rows (the step's
own rows kept there first), unless padding makes it more than DENSE_TOKENS tokens of which
half are padding (requests in lockstep, as W9's, catch up together without padding; a
straggler's catch-up beside many one-row requests runs eagerly); a prompt chunk of up to
that many tokens takes those graphs too, longer chunks and wider catch-ups run eagerly. (At acceptance 0 a batch-1 request catches up every MAX_ROWS paused
steps and before each probe: eagerly, each was a host's worth of launches.) A request of
fewer than q rows is padded after its last one: a padding token writes no KV (slot -1),
comes after every real token of its request (causal: none of them sees it), repeats the last
real position (inside the rotary table), and its output is never read.

A run stages four token rows in one copy (GraphTable.stage, with the attention buffers): the
ids, the positions, each padded token's row in the step's raw states, and each drafting
request's last real token. The raw rows are gathered into the graph's static input outside
the graph (the step's states are a new tensor each step); the replay then runs the head's
input states (EAGLE-3's fc), the head, and draft 1 of each drafting request: its id and the
state draft 2 feeds back go straight into the draft graphs' inputs (draft_graphs.py
feed_first: staged before this replay, at this graph's padded row count), and with
confidence its probability into a static buffer outside the graph pool. A proposal's host
work is then two stagings, one gather, the replays and the one read of the drafts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shoal.attention.backend import AttentionBackend
from shoal.attention.metadata import token_slots
from shoal.spec_decode.mirror_backlog import MAX_ROWS
from shoal.worker.graph_table import GraphTable, StepShape
from shoal.worker.model_graphs import VERIFY_GRAPH_SIZES

# (token ids [T], positions [T], the head's input states [T, H], attention metadata) ->
# the head's output states [T, H]
MirrorStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]
# (output states [B, H]) -> (greedy draft ids [B], their probabilities [B] or None)
PickFirst = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
# (padded rows B, draft 1 ids [B], the states draft 2 feeds back [B, H]) -> None: the draft
# graphs' first inputs (DraftGraphs.feed_first)
FeedFirst = Callable[[int, torch.Tensor, torch.Tensor], None]
# Catch-ups replay graphs up to this many requests (beyond, a padded catch-up's compute may
# cost the device more than its eager launches cost the host)
CATCH_UP_ROWS = 32
DENSE_TOKENS = 256  # below, a pass reads weights more than it computes: padding costs little


class MirrorGraphs:
    def __init__(self, step: MirrorStep, input_states: Callable[[torch.Tensor], torch.Tensor],
                 pick: PickFirst, feed: FeedFirst, backend: AttentionBackend, k: int,
                 max_num_seqs: int, max_blocks: int, device: torch.device, *,
                 block_size: int, raw: tuple[int, torch.dtype], confidence: bool,
                 sliding_window: int | None = None,
                 table_type: type[GraphTable] = GraphTable):
        """raw: (width, dtype) of a raw row (what on_launch keeps of a token; EAGLE-3: its
        aux states), which input_states turns into the head's input; feed: where draft 1
        goes; sliding_window: the head's, as its eager mirror and draft graphs attend;
        table_type: a test's stand-in for GraphTable."""
        self.step, self.input_states, self.pick, self.feed = step, input_states, pick, feed
        self.block_size = block_size
        self.sizes = [s for s in VERIFY_GRAPH_SIZES if s <= max_num_seqs]
        self.qs = sorted({1, k + 1})
        self.catch_up_q = MAX_ROWS + k + 1
        shapes = [StepShape(b, q) for b in self.sizes for q in self.qs] + [
            StepShape(b, self.catch_up_q) for b in self.sizes if b <= CATCH_UP_ROWS]
        self.shapes = sorted(shapes, key=lambda s: (s.tokens, s.rows))  # (shape_for's order)
        self.max_len = max_blocks * block_size  # positions the tables reach
        # Token ids, positions, rows in the raw states, each drafting request's last token
        self.table = table_type(backend, shapes, max_blocks, device, block_size=block_size,
                                token_rows=4, windows=(sliding_window,))
        self.max_tokens = max(s.tokens for s in shapes)  # the most tokens a step the graphs take
        self.raw = torch.zeros(self.max_tokens, raw[0], dtype=raw[1], device=device)
        self.probs = torch.zeros(self.sizes[-1], device=device) if confidence else None

    def _body(self, shape: StepShape, tokens: torch.Tensor, md: Any) -> None:
        """The mirror of shape.rows requests of shape.q tokens and their draft 1, over the
        static buffers: what a capture records."""
        rows, t = shape.rows, shape.tokens
        out = self.step(tokens[0], tokens[1], self.input_states(self.raw[:t]), md)
        last = out[tokens[3, :rows]]
        ids, p = self.pick(last)
        self.feed(rows, ids, last)
        if p is not None:
            assert self.probs is not None
            self.probs[:rows].copy_(p)

    def capture(self, pool: Any) -> float:
        return self.table.capture(self._body, pool, "mirror")

    def shape_for(self, lens: list[int], starts: list[int]) -> StepShape | None:
        """The graph of requests mirroring lens[i] rows from position starts[i]; None where
        none holds them (run eagerly)."""
        n, longest, last = len(lens), max(lens), max(starts)
        shape = next((s for s in self.shapes
                      if s.rows >= n and s.q >= longest and last + s.q <= self.max_len), None)
        if (shape is not None and shape.q == self.catch_up_q and shape.tokens > DENSE_TOKENS
                and 2 * sum(lens) < shape.tokens):
            return None  # mostly padding (a catch-up beside one-row requests): eager
        return shape

    def run(self, shape: StepShape, source: torch.Tensor, src_rows: list[int], ids: list[int],
            starts: list[int], lens: list[int], tables: list[list[int]], picks: list[int]
            ) -> torch.Tensor | None:
        """Mirrors request i's lens[i] tokens ids (flat, in request order) at positions
        starts[i].. through block table tables[i], its raw input states the rows src_rows
        (flat) of `source`, and feeds draft 1 of the requests `picks` (indices into them) to
        the draft graphs, in that order (their shape of shape.rows rows must be staged
        already). Returns draft 1's probabilities with confidence (a view of a static
        buffer: read it before the next run), else None."""
        q, bs = shape.q, self.block_size
        tok, pos, rows, slots = [], [], [], []
        at = 0
        for c, n, table in zip(starts, lens, tables):
            pad = q - n
            tok += ids[at:at + n] + [0] * pad
            pos += list(range(c, c + n)) + [c + n - 1] * pad
            rows += src_rows[at:at + n] + [src_rows[at + n - 1]] * pad
            slots += token_slots([n], [c], [table], bs) + [-1] * pad
            at += n
        last = [b * q + lens[b] - 1 for b in picks]
        staged = self.table.stage(shape, (tok, pos, rows, last), starts, [tables], [slots])
        torch.index_select(source, 0, staged[2], out=self.raw[:shape.tokens])
        self.table.replay(shape)
        return None if self.probs is None else self.probs[:len(picks)]
