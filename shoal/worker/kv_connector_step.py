"""The model runner's side of a step's KV connector plan (shoal/kv_transfer): loads written
into the requests' blocks before the forward pass, saves read out once the step's forward
pass is done (a finish hook: the rows are then computed, whatever the device)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shoal.core.kv_connector_plan import KVConnectorPlan
from shoal.core.scheduler_output import ModelRunnerOutput
from shoal.kv_transfer.rows import gather_rows, scatter_rows


def run_loads(plan: KVConnectorPlan, caches: list[torch.Tensor], block_size: int) -> None:
    for load in plan.loads:
        scatter_rows(caches, load.payload, load.block_ids, block_size, load.start,
                     load.num_tokens)


def save_hook(plan: KVConnectorPlan, caches: list[torch.Tensor], block_size: int
              ) -> Callable[[ModelRunnerOutput, bool], None]:
    saves = list(plan.saves)

    def save(out: ModelRunnerOutput, latest: bool) -> None:
        for s in saves:
            out.kv_saved[s.key] = gather_rows(caches, s.block_ids, block_size, s.num_tokens)
    return save
