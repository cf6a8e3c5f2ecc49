"""The paged KV cache of a drafter that runs its own layers (a draft model, an MTP or EAGLE
head): it shares the target's block tables and pool budget, and adds per-row scratch blocks
for the draft positions past a request's own blocks (what is written there is never read by
the target and is rewritten before the drafter reads it again)."""

from __future__ import annotations

from typing import Any

from torch import nn

from shoal.config import EngineConfig
from shoal.worker.kv_cache_sizing import allocate_kv_caches, layers_bytes_per_block


class DrafterCache:
    """Base of the proposers with layers: `model` has attention_layers(); `k` drafts a step."""

    model: nn.Module

    def _init_cache(self, config: EngineConfig, k: int) -> None:
        self.k = k
        self.device = config.device
        self.dtype = config.model_config.dtype
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.scheduler_config.max_model_len
        self.max_rows = config.scheduler_config.max_num_seqs
        self.sliding_window = getattr(self.model.attention_layers()[0], "sliding_window", None)
        self.backend = None
        self.null_block = 0
        self._scratch_base = 0
        self._scratch_per_row = -(-k // self.block_size) + 1

    def bytes_per_block(self) -> int:
        return layers_bytes_per_block(self.model.attention_layers(), self.block_size,
                                      self.dtype)

    def bind(self, num_blocks: int, backend: Any) -> None:
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
                  tables: list[list[int]], num_decodes: int) -> Any:
        return self.backend.build_metadata(
            query_lens=query_lens, context_lens=context_lens, block_tables=tables,
            block_size=self.block_size, num_decodes=num_decodes,
            sliding_window=self.sliding_window, device=self.device, null_block=self.null_block)

    def _row_table(self, row: int, blocks: list[int], needed: int) -> list[int]:
        """Row `row`'s block table for `needed` blocks: its own first, then its scratch."""
        real = list(blocks[:needed])
        scratch = self._scratch_base + row * self._scratch_per_row
        return real + list(range(scratch, scratch + needed - len(real)))
