"""The model runner's side of a step's KV connector plan (shoal/kv_transfer): loads written
into the requests' blocks before the forward pass (queued on the device: from pinned host
memory on CUDA, so the step does not wait for them), saves read out once the step's forward
pass is done (a finish hook: the rows are then computed, whatever the device) into one host
buffer each, which the connector serves once its copies have landed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shoal.core.kv_connector_plan import KVConnectorPlan
from shoal.core.scheduler_output import ModelRunnerOutput
from shoal.kv_transfer.rows import gather_rows, scatter_rows


class LoadKeeper:
    """Host buffers of loads still being copied to the device (asynchronous copies from
    pinned memory): each is let go once an event recorded after its copies has passed."""

    def __init__(self) -> None:
        self._inflight: list[tuple[torch.cuda.Event, list[Any]]] = []

    def keep(self, buffers: list[Any]) -> None:
        event = torch.cuda.Event()
        event.record()
        self._inflight.append((event, buffers))
        self._inflight = [(e, b) for e, b in self._inflight if not e.query()]

    def __len__(self) -> int:
        return len(self._inflight)


_keeper = LoadKeeper()


def run_loads(plan: KVConnectorPlan, caches: list[torch.Tensor], block_size: int) -> None:
    for load in plan.loads:
        scatter_rows(caches, load.layout, load.data, load.block_ids, block_size, load.start,
                     load.num_tokens)
    if plan.loads and caches[0].device.type == "cuda":
        _keeper.keep([load.data for load in plan.loads])


def save_hook(plan: KVConnectorPlan, caches: list[torch.Tensor], block_size: int
              ) -> Callable[[ModelRunnerOutput, bool], None]:
    saves = list(plan.saves)

    def save(out: ModelRunnerOutput, latest: bool) -> None:
        for s in saves:
            out.kv_saved[s.key] = gather_rows(caches, s.block_ids, block_size, s.num_tokens)
    return save
