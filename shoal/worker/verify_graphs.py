"""CUDA graphs for the verify steps of speculative decoding.

A verify step runs every request on its last token plus its drafts: up to k + 1 query tokens
after its cached context, all of which give logits. Run eagerly its kernels are launched one
Python call at a time, which on the H200's host took 16 ms a step for Llama-3.1-8B against
4.6 ms for a decode graph: the drafts' win was eaten by launch overhead. When every request of
a step samples from at most k + 1 new tokens (the adaptive budget gives requests different
draft counts, and some none), each request is padded to k + 1 tokens and the batch to a
captured size (1 .. 64 requests), and one graph replays: token ids and positions staged, the
attention metadata in the backend's verify buffers, the LM head on all B * (k + 1) rows.
Padding tokens write no KV; the runner picks the real rows. Shares the decode graphs' pool."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from shoal.attention.backend import AttentionBackend
from shoal.worker.staged_tokens import StagedTokens

logger = logging.getLogger(__name__)

# Speculation pays at small batches; the logits of B * (k + 1) rows bound the largest.
VERIFY_GRAPH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)


class VerifyGraphs:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, k: int,
                 max_num_seqs: int, max_blocks: int, device: torch.device, *,
                 block_size: int, sliding_window: int | None, keep_hidden: bool = False):
        self.model = model
        self.keep_hidden = keep_hidden  # as DecodeGraphs
        self.backend = backend
        self.q = k + 1
        self.sizes = [s for s in VERIFY_GRAPH_SIZES if s <= max_num_seqs]
        self.max_batch = self.sizes[-1]
        self.device = device
        self.tokens = StagedTokens(2, self.max_batch * self.q, device)
        self.buffers = backend.alloc_verify_graph_buffers(
            self.max_batch, self.q, max_blocks, device, block_size=block_size,
            sliding_window=sliding_window)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # every token's model output (MTP reads it)
        self.last_hidden: torch.Tensor | None = None  # of the last run's tokens

    def can_run(self, num_requests: int, query_lens: list[int]) -> bool:
        """Whether a step of these requests' query lengths (each padded to q) replays a
        graph."""
        return (bool(self.graphs) and 0 < num_requests <= self.max_batch
                and all(0 < n <= self.q for n in query_lens))

    def pick(self, num_requests: int, query_lens: list[int]) -> VerifyGraphs | None:
        return self if self.can_run(num_requests, query_lens) else None

    def padded_size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        md = self.backend.verify_graph_metadata(self.buffers, size)
        ids, pos = self.tokens.view(size * self.q)
        hidden = self.model(ids, pos, md)
        return self.model.compute_logits(hidden), hidden

    @torch.inference_mode()
    def capture(self, pool: Any) -> float:
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for size in reversed(self.sizes):  # largest first: the smaller ones reuse its blocks
            self.backend.fill_verify_graph_buffers(self.buffers, size, [], [], [])
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm: compile kernels, settle the allocator
                    self._forward(size)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                out, hidden = self._forward(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
            self.outputs[size] = out
            if self.keep_hidden:
                self.hidden[size] = hidden
        torch.cuda.synchronize(self.device)
        took = time.perf_counter() - t0
        logger.info("captured %d verify CUDA graphs (1..%d requests of %d tokens) in %.1f s",
                    len(self.sizes), self.max_batch, self.q, took)
        return took

    def run(self, input_ids: list[int], positions: list[int], context_lens: list[int],
            block_tables: list[list[int]], slot_mapping: list[int],
            fill_pending: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """A verify step of len(context_lens) requests, q tokens each (the caller pads
        shorter ones: slot -1), in request order; returns the logits of all their tokens
        [n * q, V]."""
        n = len(context_lens)
        size = self.padded_size(n)
        ids, _ = self.tokens.stage(size * self.q, (input_ids, positions))
        if fill_pending is not None:
            fill_pending(ids)
        self.backend.fill_verify_graph_buffers(self.buffers, size, context_lens, block_tables,
                                               slot_mapping)
        self.graphs[size].replay()
        self.last_hidden = self.hidden[size][:n * self.q] if self.keep_hidden else None
        return self.outputs[size][:n * self.q]


def draft_ladder(k: int) -> list[int]:
    """The draft counts verify graphs are captured for: 1, 2, 4, ... and k. A step replays
    the smallest that holds its longest request, so a batch whose budget verifies one draft
    a request runs 2 tokens a request, not k + 1 (at batch 32 on the H200, Llama-3.1-8B,
    padding every request to 5 tokens made a verify step 1.42x a decode step)."""
    counts, d = [], 1
    while d < k:
        counts.append(d)
        d *= 2
    return counts + [k]


class VerifyGraphLadder:
    """Verify graphs for several draft counts (draft_ladder), picked per step."""

    def __init__(self, rungs: list[VerifyGraphs]):
        self.rungs = sorted(rungs, key=lambda g: g.q)

    def pick(self, num_requests: int, query_lens: list[int]) -> VerifyGraphs | None:
        for g in self.rungs:
            if g.can_run(num_requests, query_lens):
                return g
        return None

    def capture(self, pool: Any) -> float:
        return sum(g.capture(pool) for g in reversed(self.rungs))
