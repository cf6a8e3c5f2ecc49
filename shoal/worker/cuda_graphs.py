"""CUDA graphs for decode steps: one graph per padded batch size, sharing one memory pool.

A decode step has a fixed shape once its batch is padded to a capture size, so the whole
forward (every layer's kernels and the LM head) replays as one graph launch. Inputs live in persistent
buffers: a step copies its token ids, positions and attention metadata into them, replays
and reads the logits of its real rows. Prefill and mixed steps run eagerly."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from shoal.attention.backend import AttentionBackend
from shoal.worker.staged_tokens import StagedTokens

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 256, then steps of 16, capped at max_num_seqs."""
    sizes = [1, 2, 4, 8] + list(range(16, 257, 8)) + list(range(272, 1025, 16))
    out = [s for s in sizes if s <= max_num_seqs]
    if not out or out[-1] < max_num_seqs:
        out.append(max_num_seqs)
    return out


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, max_num_seqs: int,
                 max_blocks: int, device: torch.device, *, block_size: int,
                 sliding_window: int | None, keep_hidden: bool = False):
        self.model = model
        # Hold each graph's hidden-state output (for drafting from them, MTP): otherwise it
        # is an intermediate whose pool memory the smaller graphs reuse.
        self.keep_hidden = keep_hidden
        self.backend = backend
        self.sizes = capture_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.device = device
        # Token ids and positions: rows 0 and 1, one copy per step.
        self.tokens = StagedTokens(2, self.max_batch, device)
        self._tables_key: tuple | None = None
        self.buffers = backend.alloc_graph_buffers(self.max_batch, max_blocks, device,
                                                   block_size=block_size,
                                                   sliding_window=sliding_window)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # The model's output rows of each graph (MTP drafting reads them after a replay).
        self.hidden: dict[int, torch.Tensor] = {}
        self.pool = None
        self.last_hidden: torch.Tensor | None = None  # of the last run's rows

    def can_run(self, num_decodes: int, num_tokens: int) -> bool:
        return num_decodes == num_tokens and 0 < num_decodes <= self.max_batch and bool(self.graphs)

    def padded_size(self, n: int) -> int:
        for s in self.sizes:
            if s >= n:
                return s
        raise ValueError(f"batch {n} exceeds the largest captured size {self.max_batch}")

    @torch.inference_mode()
    def capture(self) -> float:
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        # Largest first, so smaller graphs reuse the pool's blocks.
        for size in reversed(self.sizes):
            self.backend.fill_graph_buffers(self.buffers, size, [], [], [])
            md = self.backend.graph_metadata(self.buffers, size)
            ids, pos = self.tokens.view(size)
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm: compile kernels, settle the allocator
                    self._forward(ids, pos, md)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out, hidden = self._forward(ids, pos, md)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[size] = graph
            self.outputs[size] = out
            if self.keep_hidden:
                self.hidden[size] = hidden
        torch.cuda.synchronize(self.device)
        took = time.perf_counter() - t0
        logger.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s", len(self.sizes),
                    self.max_batch, took)
        return took

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor,
                 md: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # Every decode row samples, so the LM head joins the graph: logits out.
        hidden = self.model(ids, pos, md)
        return self.model.compute_logits(hidden), hidden

    def invalidate_tables(self) -> None:
        self._tables_key = None

    def run(self, input_ids: list[int], positions: list[int], request_serials: list[int],
            block_tables: list[list[int]], slot_mapping: list[int],
            fill_pending: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """One decode step for len(input_ids) requests; returns their logits.
        fill_pending writes ids sampled by the step in flight into the device input ids."""
        n = len(input_ids)
        size = self.padded_size(n)
        ids, _ = self.tokens.stage(size, (input_ids, positions))
        if fill_pending is not None:
            fill_pending(ids)
        # Block tables change only when a row gains a block or the batch changes: skip the
        # copy otherwise (every 16 steps of a steady batch need one).
        key = (size, tuple(request_serials), tuple(len(t) for t in block_tables))
        # A decode token's position is the number of tokens before it.
        self.backend.fill_graph_buffers(self.buffers, size, positions,
                                        block_tables if key != self._tables_key else None,
                                        slot_mapping)
        self._tables_key = key
        self.graphs[size].replay()
        self.last_hidden = self.hidden[size][:n] if self.keep_hidden else None
        return self.outputs[size][:n]
