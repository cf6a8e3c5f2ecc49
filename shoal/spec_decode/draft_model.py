"""Method "draft_model": a smaller model with the target's vocabulary proposes k tokens by
greedy decoding (deterministic drafts: the rejection sampler's point-mass test stays exact).

Its paged KV cache is a tensor of its own that shares the target's block tables: block b of
a request holds the target's keys in the target's cache and the draft's in the draft's. So
the scheduler's allocation, prefix caching, preemption and rollback serve both. To keep it
filled, the draft runs over every step's inputs right after the target ("mirror"), and its
KV holds every position the target computed. After a step samples, the draft decodes k
tokens from each sampling request's last token (replayed as CUDA graphs once captured:
draft_graphs.py); positions past the request's blocks go to scratch blocks at the end of
the draft's cache (one set per row). What it writes past the computed tokens is overwritten
by the next mirror before anyone reads it.

Pipeline parallelism: the draft model runs on stage 0 (the drafting stage, see factory.py),
whole: every layer and the final norm, however the target's layers are split."""

from __future__ import annotations

import logging
from typing import Any

import torch

from shoal.config import EngineConfig
from shoal.config.speculative import SpeculativeConfig
from shoal.core.scheduler_output import ModelRunnerOutput
from shoal.distributed.parallel_state import get_tp_world_size, one_pipeline_stage
from shoal.host_to_device import to_device
from shoal.loader import build_model, load_model
from shoal.models.registry import has_linear_attention
from shoal.spec_decode.drafter_cache import DrafterCache
from shoal.spec_decode.drafting_rows import proposal_depth
from shoal.worker.drafter import TargetStep

logger = logging.getLogger(__name__)


class DraftModelDrafter(DrafterCache):
    def __init__(self, config: EngineConfig, spec: SpeculativeConfig):
        assert spec.model is not None
        dummy = config.model_config.load_format == "dummy"
        loaded = load_model(spec.model, load_format="dummy" if dummy else "auto")
        if has_linear_attention(loaded.hf_config):
            raise ValueError("speculative_config: a draft model with linear-attention layers "
                             f"({spec.model}) is not supported yet: its states would not "
                             "follow the target's verify steps; draft with a dense model")
        try:  # sharded like the target, over its tensor-parallel group
            with one_pipeline_stage():
                self.model = build_model(config, loaded)
        except ValueError as e:
            if get_tp_world_size() == 1:
                raise
            raise ValueError(f"speculative_config: the draft model {spec.model} cannot be split "
                             f"over tensor_parallel_size {get_tp_world_size()} as the target "
                             f"is: {e}") from e
        self._init_cache(config, spec.num_speculative_tokens)

    @torch.inference_mode()
    def on_launch(self, step: TargetStep) -> Any:
        """The draft over the target step's own inputs (the tokens of a step still in flight
        filled in on the device): its KV then covers what the target's does."""
        inp = step.inputs
        md = self._metadata(inp.query_lens(), inp.context_lens(), inp.block_tables(),
                            inp.num_decodes)
        self.model(step.input_ids(), to_device(inp.positions, torch.long, self.device), md)
        return None

    def propose(self, step: TargetStep, state: Any, out: ModelRunnerOutput,
                latest: bool) -> None:
        if not latest:  # its KV mirrors every step at launch, drafted or not
            return
        # The draft limits (issue 38): a request drafts no more than its next step can verify
        # for the outcome it had (none while paused); the batch drafts to the deepest limit.
        inp, rows, limits = step.inputs, [], []
        for it, st in zip(inp.items, inp.states):
            depth = proposal_depth(it, st, self.k) if it.sample else 0
            if depth and it.serial in out.sampled_token_ids:
                rows.append((it, st))
                limits.append(depth)
        if not rows:
            return
        drafts = self.propose_batch([st.all_token_ids() for _, st in rows],
                                    [it.block_ids for it, _ in rows], max(limits))
        for (it, _), d, limit in zip(rows, drafts, limits):
            if d:
                out.draft_token_ids[it.serial] = d[:limit]

    @torch.inference_mode()
    def propose_batch(self, seqs: list[list[int]], tables: list[list[int]],
                      depth: int | None = None) -> list[list[int]]:
        """Greedy drafts for each sequence (its tokens; all but the last are in the draft's
        KV), up to depth (default k), fewer near max_model_len."""
        rows = [i for i, s in enumerate(seqs) if len(s) < self.max_model_len - 1]
        if not rows:
            return [[] for _ in seqs]
        k = min(self.k if depth is None else depth,
                self.max_model_len - 1 - max(len(seqs[i]) for i in rows))
        if k < 1:
            return [[] for _ in seqs]
        start = [len(seqs[i]) - 1 for i in rows]
        need = [-(-(p + k) // self.block_size) for p in start]
        row_tables = [self._row_table(r, tables[i], n) for r, (i, n) in enumerate(zip(rows, need))]
        ids = to_device([seqs[i][-1] for i in rows], torch.long, self.device)
        drafts = self._greedy_steps(ids, None, start, row_tables, k).tolist()
        result: list[list[int]] = [[] for _ in seqs]
        for r, i in enumerate(rows):
            result[i] = drafts[r]
        return result

    def _draft_step(self, ids: torch.Tensor, positions: torch.Tensor,
                    hidden: torch.Tensor | None, md: Any
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.model.compute_logits(self.model(ids, positions, md)).argmax(dim=-1), None
