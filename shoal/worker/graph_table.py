"""CUDA graphs keyed by the step's shape, over one set of persistent inputs and one memory pool.

A step of a fixed shape (rows x tokens per row, padded) launches the same kernels with the
same arguments every time once its inputs sit at fixed addresses, so it replays as one graph
launch instead of a few hundred Python-issued kernel launches. The shapes (vLLM's
CudagraphDispatcher keys them the same way; mini-sglang has one graph runner too):

- decode: one token per row, rows padded to a capture size;
- verify (speculative decoding): k + 1 tokens per row, every token giving logits;
- a lone prefill chunk: one row of up to 512 tokens, logits of its last real token only.

Inputs live in persistent buffers: token rows (ids, positions, and each row's last real
token) staged by StagedTokens, and the attention backend's graph buffers (sequence lengths,
block tables, slots: AttentionBackend.alloc/fill_graph_buffers, graph_metadata). A step stages
its inputs into them and replays its shape's graph. What a graph computes is its `body`:
the model's forward and logits (worker/model_graphs.py), or a drafter's greedy step, which
moves its own inputs on with the backend's advance_graph_buffers (spec_decode/draft_graphs.py)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from shoal.attention.backend import AttentionBackend
from shoal.attention.metadata import GroupedMetadata
from shoal.worker.staged_tokens import StagedTokens

logger = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class StepShape:
    rows: int  # requests, padded
    q: int  # tokens per row, padded: 1 decode, k + 1 verify, a prefill chunk's length
    # Logits per row: q (verify: every position), or 1 (a decode's token, a chunk's last)
    logits_per_row: int = 1
    # Block-table columns the graph reads (0: the table's whole width). A model whose decode
    # work follows the table width gets one graph per width (worker/model_graphs.py
    # table_widths): a step replays the narrowest that holds its longest request.
    blocks: int = 0

    @property
    def tokens(self) -> int:
        return self.rows * self.q


# body(shape, token rows [token_rows, shape.tokens] on the device, attention metadata) ->
# the graph's outputs (tensors, kept as the graph's static outputs).
GraphBody = Callable[[StepShape, torch.Tensor, Any], Any]


class GraphTable:
    def __init__(self, backend: AttentionBackend, shapes: Sequence[StepShape], max_blocks: int,
                 device: torch.device, *, block_size: int,
                 windows: Sequence[int | None] = (None,), token_rows: int = 3,
                 group_backends: Sequence[Any] | None = None):
        """windows: each KV cache group's sliding window (one set of attention buffers per
        group: their block tables and slots differ); group_backends: whose graph-buffer
        hooks serve each group (default the attention backend; a linear-state group's are
        shoal/attention/linear_state.StateGraphBuffers)."""
        if not shapes:
            raise ValueError("a graph table needs at least one shape")
        self.backend = backend
        if any(not 0 <= s.blocks <= max_blocks for s in shapes):
            raise ValueError(f"a shape's blocks must be in [0, {max_blocks}] (the tables' "
                             f"width; 0: all of it), got "
                             f"{sorted({s.blocks for s in shapes})}")
        # largest first (capture: the smaller reuse the pool's blocks), the whole width first
        self.shapes = sorted(set(shapes), reverse=True,
                             key=lambda s: (s.tokens, s.rows, s.blocks or max_blocks))
        self.device, self.block_size = device, block_size
        max_rows = max(s.rows for s in self.shapes)
        max_tokens = max(s.tokens for s in self.shapes)
        self.tokens = StagedTokens(token_rows, max_tokens, device)
        self.group_backends = list(group_backends or [backend] * len(windows))
        self.buffers = [b.alloc_graph_buffers(max_rows, max_tokens, max_blocks, device,
                                              block_size=block_size, sliding_window=w)
                        for b, w in zip(self.group_backends, windows)]
        # A sliding group's entries become the null block without its table growing: its
        # tables are copied every step.
        self._keep_tables = all(w is None for w in windows)
        self.graphs: dict[StepShape, Any] = {}
        self.outputs: dict[StepShape, Any] = {}
        self.pool: Any = None
        self._tables_key: tuple | None = None

    def __contains__(self, shape: StepShape) -> bool:
        return shape in self.graphs

    @torch.inference_mode()
    def capture(self, body: GraphBody, pool: Any = None, what: str = "step",
                before_each: Callable[[], Any] | None = None) -> float:
        """Captures body for every shape, largest first (the smaller ones reuse the pool's
        blocks); pool: a pool shared with another table (None: a new one); before_each runs
        before each warm-up run and the capture (outside the graph). Returns seconds."""
        t0 = time.perf_counter()
        stream = capture_stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for i, shape in enumerate(self.shapes):
            md = self.empty_metadata(shape)
            tokens = self.tokens.view(shape.tokens)
            with torch.cuda.stream(stream):
                # Warm: compile kernels, settle the allocator (twice for the largest shape;
                # the smaller ones reuse what it took).
                for _ in range(2 if i == 0 else 1):
                    if before_each is not None:
                        before_each()
                    body(shape, tokens, md)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            if before_each is not None:
                before_each()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[shape] = body(shape, tokens, md)
            pool = graph.pool() if pool is None else pool
            self.graphs[shape] = graph
        torch.cuda.synchronize(self.device)
        self.pool = pool
        took = time.perf_counter() - t0
        logger.info("captured %d %s CUDA graphs in %.1f s", len(self.shapes), what, took)
        return took

    def empty_metadata(self, shape: StepShape) -> Any:
        """The shape's metadata over buffers holding no real row (capture: the kernels run
        but write and read nothing); one per KV cache group, grouped when there are several."""
        mds = []
        # (a narrower shape's metadata reads the tables' first shape.blocks columns)
        narrow = {"blocks": shape.blocks} if shape.blocks else {}
        for b, buf in zip(self.group_backends, self.buffers):
            chunk = _chunk_kind(b, shape)
            b.fill_graph_buffers(buf, shape.rows, shape.q, [], [], [], **chunk)
            mds.append(b.graph_metadata(buf, shape.rows, shape.q, **narrow, **chunk))
        return GroupedMetadata.of_groups(mds)

    def invalidate_tables(self) -> None:
        """The block tables in the buffers may be stale (a step ran without the table, or a
        step failed): the next stage copies them whatever its key."""
        self._tables_key = None

    def stage(self, shape: StepShape, token_rows: Sequence[Sequence[int]],
              context_lens: list[int], block_tables: Sequence[list[list[int]]],
              slots: Sequence[list[int]], serials: Sequence[int] = (),
              state_spec: Any = None) -> torch.Tensor:
        """Copies a step's inputs into the buffers: token_rows [i] into token row i (each
        shape.tokens long at most, zero-padded), one row per real request (context length,
        and per KV cache group: block_tables[g]), per group the slots of every padded token
        (slots[g]; -1: write nothing). A decode shape's block
        tables are copied only when the rows (serials) or their lengths changed since the last
        stage: a steady decode batch needs one copy every block_size steps (its tables only
        grow; other steps, which may follow a rollback of rejected drafts, copy them always).
        state_spec goes to the group backends that take it (linear-state groups), with
        whether the shape is a lone prefill chunk.
        Returns the token rows on the device (fill pending tokens into row 0 first)."""
        if shape.blocks:  # (a narrow graph reads its rows' positions' blocks; tables may run on)
            longest = max(context_lens, default=0) + shape.q
            if longest > shape.blocks * self.block_size:
                raise ValueError(f"a request of {longest} tokens does not fit the "
                                 f"{shape.blocks} block-table columns of the graph {shape}")
        staged = self.tokens.stage(shape.tokens, token_rows)
        key = ((shape, tuple(serials), tuple(len(t) for t in block_tables[0]))
               if serials and shape.q == 1 and self._keep_tables else None)
        keep = key is not None and key == self._tables_key
        for b, buf, tables, group_slots in zip(self.group_backends, self.buffers,
                                               block_tables, slots):
            extra = ({"state_spec": state_spec, **_chunk_kind(b, shape)}
                     if getattr(b, "takes_state_spec", False) else {})
            b.fill_graph_buffers(buf, shape.rows, shape.q, context_lens,
                                 None if keep else tables, group_slots, **extra)
        self._tables_key = key
        return staged

    def replay(self, shape: StepShape) -> Any:
        self.graphs[shape].replay()
        return self.outputs[shape]


def _chunk_kind(group_backend: Any, shape: StepShape) -> dict[str, bool]:
    """A linear-state group's buffers tell a lone prefill chunk's shape from a verify's of
    one row (attention backends need not: their buffers serve both alike)."""
    if not getattr(group_backend, "takes_state_spec", False):
        return {}
    return {"lone_chunk": shape.rows == 1 and shape.q > 1 and shape.logits_per_row == 1}


def round_up(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest of sizes (ascending) that holds n, or None."""
    for s in sizes:
        if s >= n:
            return s
    return None


@functools.cache
def capture_stream(device: torch.device) -> Any:
    """The one side stream every graph capture on `device` runs on. torch keeps a cuBLAS
    workspace per stream (32 MiB on Hopper) for the life of the process, so a new stream per
    capture (every wake-up recaptures) would grow device memory by a workspace each time."""
    return torch.cuda.Stream(device)
