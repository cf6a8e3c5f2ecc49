"""The paged KV cache of a drafter that runs its own layers (a draft model, an MTP or EAGLE
head): it shares the target's block tables and pool budget, and adds per-row scratch blocks
for the draft positions past a request's own blocks (what is written there is never read by
the target and is rewritten before the drafter reads it again). Its greedy draft steps run
eagerly or, once captured, through CUDA graphs (shoal/spec_decode/draft_graphs.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.config import EngineConfig
from shoal.core.kv_cache_spec import KVCacheGroup
from shoal.host_to_device import to_device
from shoal.spec_decode.draft_graphs import DraftGraphs
from shoal.worker.draft_lockstep import PassPlan
from shoal.worker.drafter import Drafter
from shoal.worker.kv_cache_tensors import allocate_kv_caches, layer_specs


class DrafterCache(Drafter):
    """Base of the drafters with layers: `model` has attention_layers(); `k` drafts a step;
    _draft_step is one greedy step of one token a row."""

    model: nn.Module

    def _init_cache(self, config: EngineConfig, k: int) -> None:
        self.k = k
        self.device = config.device
        self.dtype = config.model_config.dtype
        self.block_size = config.cache_config.block_size
        self.max_model_len = config.scheduler_config.max_model_len
        self.max_rows = config.scheduler_config.max_num_seqs
        # The drafter's own layers say how much of the context they keep (its spec)
        first = self.model.attention_layers()[0]
        self.sliding_window = first.kv_cache_spec(self.dtype.itemsize).sliding_window
        self.backend = None
        self.null_block = 0
        self._scratch_base = 0
        self._scratch_per_row = -(-k // self.block_size) + 1
        self.graphs: DraftGraphs | None = None  # captured by capture_graphs (CUDA only)

    def kv_layers(self) -> list:
        return self.model.attention_layers()

    def bind(self, num_blocks: int, backend: Any) -> None:
        """Its cache: the shared blocks, the null block, then the rows' scratch blocks."""
        self.backend = backend
        self.null_block = num_blocks
        self._scratch_base = num_blocks + 1
        layers = self.model.attention_layers()
        total = num_blocks + 1 + self.max_rows * self._scratch_per_row
        # Every layer on the target's first table: one group, whatever its layers' kinds.
        specs = layer_specs(layers, self.dtype)
        allocate_kv_caches(layers, specs, (KVCacheGroup(specs[0], tuple(range(len(layers)))),),
                           total * self.block_size, self.dtype, self.device, self.block_size)
        for layer in layers:
            layer.backend = backend

    def _metadata(self, query_lens: list[int], context_lens: list[int],
                  tables: list[list[int]], num_decodes: int) -> Any:
        return self.backend.build_metadata(
            query_lens=query_lens, context_lens=context_lens, block_tables=tables,
            block_size=self.block_size, num_decodes=num_decodes,
            sliding_window=self.sliding_window, device=self.device, null_block=self.null_block)

    def _metadata_and_inputs(self, query_lens: list[int], context_lens: list[int],
                             tables: list[list[int]], num_decodes: int,
                             carry: list[list[int]]) -> tuple[Any, list[torch.Tensor]]:
        """_metadata and the int64 lists `carry` on the device (one copy with the Triton
        backend)."""
        return self.backend.build_metadata_and_inputs(
            carry=carry, query_lens=query_lens, context_lens=context_lens,
            block_tables=tables, block_size=self.block_size, num_decodes=num_decodes,
            sliding_window=self.sliding_window, device=self.device, null_block=self.null_block)

    def _to_index(self, rows: list[int]) -> torch.Tensor:
        """Row indices on the drafter's device."""
        return to_device(rows, torch.long, self.device)

    def _row_table(self, row: int, blocks: list[int], needed: int) -> list[int]:
        """Row `row`'s block table for `needed` blocks: its own first, then its scratch."""
        real = list(blocks[:needed])
        scratch = self._scratch_base + row * self._scratch_per_row
        return real + list(range(scratch, scratch + needed - len(real)))

    def _draft_step(self, ids: torch.Tensor, positions: torch.Tensor,
                    hidden: torch.Tensor | None, md: Any
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(argmax ids, the state fed back to the next step or None): see DraftStep."""
        raise NotImplementedError

    def _hidden_spec(self) -> tuple[int, torch.dtype] | None:
        """(size, dtype) of the state _draft_step feeds back; None: it feeds back none."""
        return None

    def pass_plan(self) -> PassPlan:
        """The passes of `model` one target step runs at most, in order (draft_lockstep.py):
        a draft model mirrors the step in one pass and drafts k; a hidden-state head mirrors
        it with each of its depths, takes draft 1 from the mirror and drafts k - 1."""
        if self.keeps_hidden:
            return PassPlan(mirror=int(getattr(self, "depths", 1)), drafting=self.k - 1)
        return PassPlan(mirror=1, drafting=self.k)

    @torch.inference_mode()
    def dummy_pass(self, depth: int = 0) -> None:
        """DP+EP (draft_lockstep.py): one made-up token through the model (a head: its
        layer `depth`, from a zero state), so that this replica joins the MoE all-to-alls of
        a pass the others run. Its KV goes to row 0's first scratch block, which a draft
        writes before it reads."""
        zero = torch.zeros(1, dtype=torch.long, device=self.device)
        md = self._metadata([1], [0], [[self._scratch_base]], 0)
        spec = self._hidden_spec()
        if spec is None:
            self.model(zero, zero, md)
            return
        state = torch.zeros(1, spec[0], dtype=spec[1], device=self.device)
        self.model(zero, zero, state, md, **({"depth": depth} if depth else {}))

    def capture_graphs(self, pool: Any, max_blocks: int,
                       graphs_type: type[DraftGraphs] = DraftGraphs) -> float:
        """Captures the greedy draft step per batch size (after bind; graphs_type: a test's
        stand-in); returns the seconds it took."""
        self.graphs = graphs_type(self._draft_step, self.backend, self.k, self.max_rows,
                                  max_blocks, self.device, block_size=self.block_size,
                                  sliding_window=self.sliding_window,
                                  hidden=self._hidden_spec())
        return self.graphs.capture(pool)

    def _greedy_steps(self, ids: torch.Tensor, hidden: torch.Tensor | None, start: list[int],
                      tables: list[list[int]], steps: int) -> torch.Tensor:
        """`steps` greedy draft steps, the first feeding ids (and hidden) at positions
        `start` (tables: the rows' block tables, long enough for every step). Returns the
        drafts [n, steps] on the device; through the graphs when captured for the batch."""
        n = len(start)
        if self.graphs is not None and self.graphs.can_run(n):
            return self.graphs.run(ids, hidden, start, tables, steps)
        out = []  # the eager steps: the reference the graphs replay
        for j in range(steps):
            pos = [p + j for p in start]
            md = self._metadata([1] * n, pos, tables, n)
            ids, hidden = self._draft_step(ids, to_device(pos, torch.long, self.device),
                                           hidden, md)
            out.append(ids)
        return torch.stack(out, dim=1)
