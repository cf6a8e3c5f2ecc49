"""Method "draft_model": a smaller model with the target's vocabulary proposes k tokens by
greedy decoding (deterministic drafts: the rejection sampler's point-mass test stays exact).

Its paged KV cache is a tensor of its own that shares the target's block tables: block b of
a request holds the target's keys in the target's cache and the draft's in the draft's. So
the scheduler's allocation, prefix caching, preemption and rollback serve both. To keep it
filled, the draft runs over every step's inputs right after the target ("mirror"), and its
KV holds every position the target computed. After a step samples, the draft decodes k
tokens from each sampling request's last token; positions past the request's blocks go to
scratch blocks at the end of the draft's cache (one set per row). What it writes past the
computed tokens is overwritten by the next mirror before anyone reads it."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from shoal.config import EngineConfig
from shoal.host_to_device import to_device
from shoal.loader import build_model, load_model
from shoal.spec_decode.config import SpeculativeConfig
from shoal.worker.kv_cache_sizing import allocate_kv_caches, layers_bytes_per_block

logger = logging.getLogger(__name__)


class DraftModelProposer:
    def __init__(self, config: EngineConfig, spec: SpeculativeConfig):
        assert spec.model is not None
        dummy = config.model_config.load_format == "dummy"
        loaded = load_model(spec.model, load_format="dummy" if dummy else "auto")
        self.model = build_model(config, loaded)
        self.k = spec.num_speculative_tokens
        self.device = config.device
        self.dtype = config.model_config.dtype
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.scheduler_config.max_model_len
        self.max_rows = config.scheduler_config.max_num_seqs
        layers = self.model.attention_layers()
        self.sliding_window = layers[0].sliding_window
        self.backend = None
        self.null_block = 0
        self._scratch_base = 0
        self._scratch_per_row = -(-self.k // self.block_size) + 1

    def bytes_per_block(self) -> int:
        return layers_bytes_per_block(self.model.attention_layers(), self.block_size,
                                      self.dtype)

    def bind(self, num_blocks: int, backend) -> None:
        """Its cache: the shared blocks, the null block, then the rows' scratch blocks."""
        self.backend = backend
        self.null_block = num_blocks
        self._scratch_base = num_blocks + 1
        layers = self.model.attention_layers()
        total = num_blocks + 1 + self.max_rows * self._scratch_per_row
        allocate_kv_caches(layers, total * self.block_size, self.dtype, self.device)
        for layer in layers:
            layer.backend = backend

    def _metadata(self, query_lens: list[int], context_lens: list[int],
                  tables: list[list[int]], num_decodes: int):
        return self.backend.build_metadata(
            query_lens=query_lens, context_lens=context_lens, block_tables=tables,
            block_size=self.block_size, num_decodes=num_decodes,
            sliding_window=self.sliding_window, device=self.device, null_block=self.null_block)

    @torch.inference_mode()
    def mirror(self, input_ids: list[int], positions: list[int], items: Sequence,
               num_decodes: int) -> None:
        """The draft over the step's own inputs: its KV then covers what the target's does."""
        md = self._metadata([it.num_new_tokens for it in items],
                            [it.context_len for it in items],
                            [it.block_ids for it in items], num_decodes)
        self.model(to_device(input_ids, torch.long, self.device),
                   to_device(positions, torch.long, self.device), md)

    @torch.inference_mode()
    def propose_batch(self, seqs: list[list[int]], tables: list[list[int]]) -> list[list[int]]:
        """Greedy drafts for each sequence (its tokens; all but the last are in the draft's
        KV), up to k, fewer near max_model_len."""
        rows = [i for i, s in enumerate(seqs) if len(s) < self.max_model_len - 1]
        if not rows:
            return [[] for _ in seqs]
        k = min(self.k, self.max_model_len - 1 - max(len(seqs[i]) for i in rows))
        if k < 1:
            return [[] for _ in seqs]
        start = [len(seqs[i]) - 1 for i in rows]
        need = [-(-(p + k) // self.block_size) for p in start]
        row_tables = []
        for r, (i, n) in enumerate(zip(rows, need)):
            real = list(tables[i][:n])
            scratch = self._scratch_base + r * self._scratch_per_row
            row_tables.append(real + list(range(scratch, scratch + n - len(real))))
        ids = to_device([seqs[i][-1] for i in rows], torch.long, self.device)
        out = []
        for j in range(k):
            pos = [p + j for p in start]
            md = self._metadata([1] * len(rows), pos, row_tables, len(rows))
            hidden = self.model(ids, to_device(pos, torch.long, self.device), md)
            ids = self.model.compute_logits(hidden).argmax(dim=-1)
            out.append(ids)
        drafts = torch.stack(out, dim=1).tolist()
        result: list[list[int]] = [[] for _ in seqs]
        for r, i in enumerate(rows):
            result[i] = drafts[r]
        return result
