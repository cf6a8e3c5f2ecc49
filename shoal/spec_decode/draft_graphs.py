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

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from shoal.attention.backend import AttentionBackend
from shoal.attention.metadata import token_slots
from shoal.worker.staged_tokens import StagedTokens
from shoal.worker.verify_graphs import VERIFY_GRAPH_SIZES

logger = logging.getLogger(__name__)

# step(token ids [B], positions [B], hidden [B, H] or None, attention metadata) ->
# (argmax ids [B], the state a head feeds back [B, H] or None): one greedy draft step.
DraftStep = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, Any],
                     tuple[torch.Tensor, torch.Tensor | None]]


class DraftGraphs:
    def __init__(self, step: DraftStep, backend: AttentionBackend, max_steps: int,
                 max_num_seqs: int, max_blocks: int, device: torch.device, *,
                 block_size: int, sliding_window: int | None,
                 hidden: tuple[int, torch.dtype] | None = None):
        """hidden: (size, dtype) of the state a head feeds back (None: a draft model)."""
        self.step = step
        self.backend = backend
        self.block_size = block_size
        # Speculation pays at small batches: the verify graphs' sizes.
        self.sizes = [s for s in VERIFY_GRAPH_SIZES if s <= max_num_seqs]
        self.max_batch = self.sizes[-1]
        self.max_steps = max_steps
        self.tokens = StagedTokens(2, self.max_batch, device)  # token ids, positions
        self.hidden = (None if hidden is None else
                       torch.zeros(self.max_batch, hidden[0], dtype=hidden[1], device=device))
        self.drafts = torch.zeros(self.max_batch, max_steps, dtype=torch.long, device=device)
        self.step_index = torch.zeros(1, dtype=torch.long, device=device)  # drafts' column
        self.buffers = backend.alloc_graph_buffers(self.max_batch, max_blocks, device,
                                                   block_size=block_size,
                                                   sliding_window=sliding_window)
        self.graphs: dict[int, Any] = {}
        self.device = device

    def can_run(self, n: int) -> bool:
        return bool(self.graphs) and 0 < n <= self.max_batch

    def padded_size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _replayed(self, size: int, md: Any) -> None:
        """One draft step over the static buffers of a graph of `size` rows, which it then
        moves on to the next step's inputs: what a capture records."""
        ids, pos = self.tokens.view(size)
        hidden = None if self.hidden is None else self.hidden[:size]
        next_ids, next_hidden = self.step(ids, pos, hidden, md)
        self.drafts[:size].index_copy_(1, self.step_index, next_ids[:, None])
        self.step_index.add_(1)
        ids.copy_(next_ids)
        if hidden is not None:
            assert next_hidden is not None
            hidden.copy_(next_hidden)
        pos.add_(1)
        self.backend.advance_graph_buffers(self.buffers, size)

    @torch.inference_mode()
    def capture(self, pool: Any) -> float:
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its blocks
            # All rows padding: nothing is written to the cache while warming or capturing.
            self.backend.fill_graph_buffers(self.buffers, size, [], [], [])
            md = self.backend.graph_metadata(self.buffers, size)
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm: compile kernels, settle the allocator
                    self.step_index.zero_()  # the drafts' column stays in range
                    self._replayed(size, md)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self._replayed(size, md)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        took = time.perf_counter() - t0
        logger.info("captured %d drafting CUDA graphs (batch 1..%d) in %.1f s",
                    len(self.sizes), self.max_batch, took)
        return took

    def run(self, ids: torch.Tensor, hidden: torch.Tensor | None, positions: list[int],
            tables: list[list[int]], steps: int) -> torch.Tensor:
        """`steps` greedy draft steps for len(positions) rows: row i's first step feeds
        ids[i] (and hidden[i]) at positions[i] through block table tables[i], which covers
        every position the steps write. Returns the drafts [n, steps] on the device (a view
        of a static buffer: read it before the next run)."""
        n = len(positions)
        if steps > self.max_steps:
            raise ValueError(f"{steps} draft steps, the graphs hold {self.max_steps}")
        size = self.padded_size(n)
        staged_ids, _ = self.tokens.stage(size, ([], positions))
        staged_ids[:n].copy_(ids)
        if self.hidden is not None:
            assert hidden is not None
            self.hidden[:n].copy_(hidden)
        # A decode row's context length is its new token's position.
        self.backend.fill_graph_buffers(
            self.buffers, size, positions, tables,
            token_slots([1] * n, positions, tables, self.block_size))
        self.step_index.zero_()
        graph = self.graphs[size]
        for _ in range(steps):
            graph.replay()
        return self.drafts[:n, :steps]
