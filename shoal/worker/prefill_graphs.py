"""CUDA graphs for steps that prefill one short chunk of one request and nothing else.

That is the step a lone request's time to first token waits for (a new prompt, or the tail
after a prefix-cache hit). Run eagerly, its few hundred kernels are launched one Python call
at a time, which on a slow host costs more than the GPU work of a few hundred tokens. Here
the chunk is padded to a captured size (16 .. 512 tokens); the padding rows write no KV
(slot -1) and the LM head runs on the last real token only, picked by a device index.
Shares the memory pool of the decode graphs."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from shoal.attention.backend import AttentionBackend
from shoal.worker.staged_tokens import StagedTokens

logger = logging.getLogger(__name__)

PREFILL_GRAPH_SIZES = (16, 32, 64, 128, 256, 512)


class PrefillGraphs:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, max_tokens: int,
                 max_blocks: int, device: torch.device, *, block_size: int,
                 sliding_window: int | None, keep_hidden: bool = False):
        self.model = model
        self.keep_hidden = keep_hidden  # as DecodeGraphs
        self.backend = backend
        self.sizes = [s for s in PREFILL_GRAPH_SIZES if s <= max_tokens]
        self.max_size = self.sizes[-1] if self.sizes else 0
        self.device = device
        # Rows: token ids, positions, and in [2, 0] the index of the last real token.
        self.tokens = StagedTokens(3, max(self.max_size, 1), device)
        self.buffers = backend.alloc_prefill_graph_buffers(max(self.max_size, 1), max_blocks,
                                                           device, block_size=block_size,
                                                           sliding_window=sliding_window)
        self.graphs: dict[int, Any] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # every token's model output (MTP reads it)
        self.last_hidden: torch.Tensor | None = None  # of the last run's tokens

    def can_run(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_size and bool(self.graphs)

    def padded_size(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        md = self.backend.prefill_graph_metadata(self.buffers, size)
        ids, pos, last = self.tokens.view(size)
        hidden = self.model(ids, pos, md)
        return self.model.compute_logits(hidden.index_select(0, last[:1])), hidden

    @torch.inference_mode()
    def capture(self, pool: Any) -> float:
        t0 = time.perf_counter()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for size in reversed(self.sizes):
            # An empty chunk: the kernels run but write and read nothing.
            self.backend.fill_prefill_graph_buffers(self.buffers, size, 0, [], [])
            with torch.cuda.stream(stream):
                for _ in range(2):
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
        logger.info("captured %d prefill CUDA graphs (%s tokens) in %.1f s", len(self.sizes),
                    "/".join(map(str, self.sizes)), took)
        return took

    def run(self, input_ids: list[int], positions: list[int], context_len: int,
            block_table: list[int], slot_mapping: list[int],
            fill_pending: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """One chunk of len(input_ids) tokens; returns the logits of its last token [1, V]."""
        n = len(input_ids)
        size = self.padded_size(n)
        ids = self.tokens.stage(size, (input_ids, positions, (n - 1,)))[0]
        if fill_pending is not None:
            fill_pending(ids)
        self.backend.fill_prefill_graph_buffers(self.buffers, size, context_len, block_table,
                                                slot_mapping)
        self.graphs[size].replay()
        self.last_hidden = self.hidden[size][:n] if self.keep_hidden else None
        return self.outputs[size]
