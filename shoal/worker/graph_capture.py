"""Capturing a runner's CUDA graphs: which step shapes get one, whose buffer hooks serve
each KV cache group, and what runs eagerly instead.

The rule for a model class has three cases: one that cannot be captured declares
`eager_only_reason` (graph_support.py logs it and the engine runs eagerly); one that can
capture decodes only declares `decode_graphs_only` (chunks and verifies run eagerly); code
that is not shoal's (the Transformers backend) sets `check_graph_capture` and its graphs are
captured on trial and checked (graph_check.py). Hybrids capture every shape: decodes, verifies (StateRows) and
lone prefill chunks (their padding masked out of the linear states; with prefix caching a
chunk replays only from a block start, model_graphs.py). A class whose decode work follows the block
tables' width declares `decode_table_buckets_from` (tokens): its decode graphs are captured
per table width as well, doubling from there (model_graphs.py table_widths).

ModelRunner takes this side from RunnerGraphCapture, beside its other mixins."""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch

from shoal.attention.linear_state import StateGraphBuffers
from shoal.worker.encoder_graphs import EncoderGraphs
from shoal.worker.graph_check import (
    capture_checked,
    describe_error,
    end_capture_state,
    stream_kept,
)
from shoal.worker.model_graphs import ModelGraphs, step_shapes, table_widths

logger = logging.getLogger(__name__)


class RunnerGraphCapture:
    # (set by ModelRunner)
    config: Any
    model: Any
    backend: Any
    device: Any
    block_size: int
    kv_groups: list
    forwarder: Any
    drafter: Any
    startup_times: dict[str, float]
    graphs: ModelGraphs | None
    null_block: int

    def _capture_graphs(self) -> None:
        sc = self.config.scheduler_config
        spec = self.config.speculative_config
        max_blocks = -(-sc.max_model_len // self.block_size)
        narrowest = getattr(self.model, "decode_table_buckets_from", None)
        widths = (table_widths(max_blocks, -(-narrowest // self.block_size))
                  if narrowest else [])
        shapes = step_shapes(sc.max_num_seqs, sc.max_num_batched_tokens,
                             num_speculative_tokens=spec.num_speculative_tokens
                             if spec is not None else 0, decode_widths=widths)
        # decode graphs only (graph_support.py logged why): chunks and verifies run eagerly
        if getattr(self.model, "decode_graphs_only", None):
            shapes = [s for s in shapes if s.q == 1]
        if getattr(self.model, "check_graph_capture", False):  # not shoal's code: on trial
            self.graphs = self._graphs(shapes, max_blocks)
            took = capture_checked(self.graphs, self)
        elif self.has_linear_states:
            took = self._capture_hybrid(shapes, max_blocks)
        else:
            self.graphs = self._graphs(shapes, max_blocks)
            took = self.graphs.capture()
        if took is None:  # it runs eagerly, as with enforce_eager (graph_check.py logged why)
            self.graphs = None
            return
        self.startup_times["cuda_graphs"] = took
        if hasattr(self.model, "encoder_graphs"):  # the vision tower's, captured per grid
            self.model.encoder_graphs = EncoderGraphs(self.model.visual, self.device)
        if self.drafter is not None:
            # Drafting steps as graph replays: eagerly each one pays the launches.
            self.startup_times["draft_graphs"] = self.drafter.capture_graphs(
                self.graphs.pool, max_blocks)

    def _graphs(self, shapes: list, max_blocks: int) -> ModelGraphs:
        return ModelGraphs(self.model, self.backend, shapes, max_blocks, self.device,
                           block_size=self.block_size, windows=self.forwarder.windows,
                           keep_hidden=self.forwarder.keep_hidden,
                           group_backends=self.graph_group_backends())

    def _capture_hybrid(self, shapes: list, max_blocks: int) -> float:
        """A hybrid's graphs; if a lone prefill chunk's cannot be captured (its chunked-rule
        kernels, fla-core's on CUDA, doing what a capture refuses), the decodes and verifies
        alone, chunks then running eagerly (logged)."""
        kept = [s for s in shapes if s.q == 1 or s.logits_per_row > 1]
        self.graphs = self._graphs(shapes, max_blocks)
        failure = None
        try:
            with stream_kept(self.device):
                return self.graphs.capture()
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - any capture failure: the chunks go eager
            if len(kept) == len(shapes):
                raise
            failure = describe_error(e)
        # (outside the except: its traceback would keep the failed graphs' pool alive while
        # the second capture builds its own)
        logger.warning("capturing %s's prefill chunks raised %s: they run eagerly (decode "
                       "and verify steps keep their CUDA graphs)", type(self.model).__name__,
                       failure)
        self.graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            end_capture_state(self.device)
            gc.collect()
            torch.cuda.empty_cache()
        self.graphs = self._graphs(kept, max_blocks)
        return self.graphs.capture()

    @property
    def has_linear_states(self) -> bool:
        return any(g.holds_state for g in self.kv_groups)

    def graph_group_backends(self) -> list:
        """Whose graph-buffer hooks serve each KV cache group in CUDA graphs."""
        return [StateGraphBuffers(self.null_block, self.null_block + 1, self.block_size,
                                  save_block_ends=self.forwarder.save_states)
                if g.holds_state else self.backend for g in self.kv_groups]
