"""CUDA graphs of a drafter's greedy steps (speculative decoding): one graph per padded batch
size, each ONE draft step of one token a request.

A drafter (a draft model; an MTP or EAGLE head) proposes its k tokens one small forward at a
time. Run eagerly each step is a host's worth of kernel launches (1.5-3 ms a step on the
H200's host for an 8B-class model), so the drafts cost more than they save. Every input of
the next step is on the device already: its token is this step's argmax, a head's hidden
state is this step's output, its position and sequence lengths are one more. So the captured
step advances its own inputs: it writes its argmax into the token buffer and into its column
of the drafts, its output state into the hidden buffer, and moves the positions and the
backend's decode metadata one token on (AttentionBackend.advance_graph_buffers). A proposal
stages the first step's inputs once, replays `steps` times back to back and reads all drafts
at the end. The static buffers live outside the graph pool (shared with the runner's other
graphs), so no other graph's replay overwrites them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shoal.attention.backend import AttentionBackend
from shoal.attention.metadata import token_slots
from shoal.worker.graph_table import GraphTable, StepShape, round_up
from shoal.worker.model_graphs import VERIFY_GRAPH_SIZES

# step(token ids [B], positions [B], hidden [B, H] or None, attention metadata) ->
# (argmax ids [B], the state a head feeds back [B, H] or None): one greedy draft step.
DraftStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, Any],
                     tuple[torch.Tensor, torch.Tensor | None]]


class DraftGraphs:
    def __init__(self, step: DraftStep, backend: AttentionBackend, max_steps: int,
                 max_num_seqs: int, max_blocks: int, device: torch.device, *,
                 block_size: int, sliding_window: int | None,
                 hidden: tuple[int, torch.dtype] | None = None,
                 table_type: type[GraphTable] = GraphTable):
        """hidden: (size, dtype) of the state a head feeds back (None: a draft model);
        table_type: a test's stand-in for GraphTable."""
        self.step = step
        self.backend = backend
        self.block_size = block_size
        # Speculation pays at small batches: the verify graphs' sizes.
        self.sizes = [s for s in VERIFY_GRAPH_SIZES if s <= max_num_seqs]
        self.max_batch = self.sizes[-1]
        self.max_steps = max_steps
        # Token ids and positions; decode shapes: one token a row.
        self.table = table_type(backend, [StepShape(b, 1) for b in self.sizes], max_blocks,
                                device, block_size=block_size, windows=(sliding_window,),
                                token_rows=2)
        self.hidden = (None if hidden is None else
                       torch.zeros(self.max_batch, hidden[0], dtype=hidden[1], device=device))
        self.drafts = torch.zeros(self.max_batch, max_steps, dtype=torch.long, device=device)
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)  # drafts' column

    def can_run(self, n: int) -> bool:
        return bool(self.table.graphs) and 0 < n <= self.max_batch

    def _body(self, shape: StepShape, tokens: torch.Tensor, md: Any) -> None:
        """One draft step over the static buffers of a graph of `shape.rows` rows, which it
        then moves on to the next step's inputs: what a capture records."""
        size = shape.rows
        ids, pos = tokens[0], tokens[1]
        hidden = None if self.hidden is None else self.hidden[:size]
        next_ids, next_hidden = self.step(ids, pos, hidden, md)
        self.drafts[:size].index_copy_(1, self.step_index, next_ids[:, None])
        self.step_index.add_(1)
        ids.copy_(next_ids)
        if hidden is not None:
            assert next_hidden is not None
            hidden.copy_(next_hidden)
        pos.add_(1)
        self.backend.advance_graph_buffers(self.table.buffers[0], size)

    def capture(self, pool: Any) -> float:
        # The drafts' column stays in range while warming up (each run moves it on).
        return self.table.capture(self._body, pool, "drafting",
                                  before_each=self.step_index.zero_)

    def stage(self, positions: list[int], tables: list[list[int]],
              rows: int = 0) -> tuple[StepShape, torch.Tensor]:
        """Stages the first step's positions and attention buffers of len(positions) rows:
        row i at positions[i] through block table tables[i], which covers every position the
        steps write; padded to a captured size of at least `rows`. Returns the shape to
        replay and its token rows on the device (ids, still to be fed with the hidden
        states: run, or a mirror graph's feed_first; positions)."""
        n = len(positions)
        size = round_up(max(n, rows), self.sizes)
        if size is None:
            raise ValueError(f"{max(n, rows)} rows, the draft graphs hold {self.max_batch}")
        shape = StepShape(size, 1)
        # A decode row's context length is its new token's position.
        staged = self.table.stage(shape, ([], positions), positions, [tables],
                                  [token_slots([1] * n, positions, tables, self.block_size)])
        return shape, staged

    def feed_first(self, rows: int, ids: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """The first step's inputs of a shape of `rows` rows, as draft 1 (ids) and the state
        it feeds back, also column 0 of the drafts: the steps then write columns 1 onwards.
        Device work only: a graph that computes draft 1 (the mirror's, mirror_graphs.py)
        records it."""
        self.table.tokens.view(rows)[0].copy_(ids)  # (token row 0 of the shape's view)
        if self.hidden is not None:
            assert hidden is not None
            self.hidden[:rows].copy_(hidden)
        self.drafts[:rows, 0].copy_(ids)
        self.step_index.fill_(1)

    def replay(self, shape: StepShape, n: int, steps: int, first_column: int = 0
               ) -> torch.Tensor:
        """`steps` replays of a staged and fed shape; returns the drafts of its first n rows,
        columns [0, first_column + steps) (a view of a static buffer: read it before the next
        run). first_column: the column the first step writes (1 after feed_first)."""
        if first_column + steps > self.max_steps:
            raise ValueError(f"{first_column + steps} draft columns, the graphs hold "
                             f"{self.max_steps}")
        for _ in range(steps):
            self.table.replay(shape)
        return self.drafts[:n, :first_column + steps]

    def run(self, ids: torch.Tensor, hidden: torch.Tensor | None, positions: list[int],
            tables: list[list[int]], steps: int) -> torch.Tensor:
        """`steps` greedy draft steps for len(positions) rows: row i's first step feeds
        ids[i] (and hidden[i]) at positions[i] through block table tables[i], which covers
        every position the steps write. Returns the drafts [n, steps] on the device (a view
        of a static buffer: read it before the next run)."""
        n = len(positions)
        if steps > self.max_steps:
            raise ValueError(f"{steps} draft steps, the graphs hold {self.max_steps}")
        shape, staged = self.stage(positions, tables)
        staged[0, :n].copy_(ids)
        if self.hidden is not None:
            assert hidden is not None
            self.hidden[:n].copy_(hidden)
        self.step_index.zero_()
        return self.replay(shape, n, steps)
