"""The model runner's side of a step's KV connector plan (shoal/kv_transfer): loads written
into the requests' blocks before the forward pass (queued on the device: from pinned host
memory on CUDA, so the step does not wait for them), saves read out once the step's forward
pass is done (a finish hook: the rows are then computed, whatever the device) into one host
buffer each, which the connector serves once its copies have landed. Each layer's rows follow
its KV cache group's block table (rows.LayerTables: sliding windows beside full attention)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shoal.core.kv_connector_plan import KVConnectorPlan
from shoal.core.scheduler_output import ModelRunnerOutput
from shoal.distributed.parallel_state import get_tp_rank
from shoal.kv_transfer.rows import LayerTables, gather_rows, scatter_rows
from shoal.kv_transfer.shared import open_rows


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


def run_loads(plan: KVConnectorPlan, caches: list[torch.Tensor], block_size: int,
              tables: LayerTables | None = None) -> None:
    """A load's bytes come in the plan, or as a handle to shared memory where every
    tensor-parallel rank of this host maps its own link (kv_transfer/shared.py) and reads
    only its heads. (A consumer has one pipeline stage: kv_transfer/factory.py.)"""
    rank = get_tp_rank()
    buffers = [open_rows(load.data, rank) for load in plan.loads]
    for load, data in zip(plan.loads, buffers):
        scatter_rows(caches, load.layout, data, load.block_ids, block_size, load.start,
                     load.num_tokens, tables, load.group_block_ids)
    if plan.loads and caches[0].device.type == "cuda":
        _keeper.keep(buffers)


def save_hook(plan: KVConnectorPlan, caches: list[torch.Tensor], block_size: int,
              tables: LayerTables | None = None) -> Callable[[ModelRunnerOutput, bool], None]:
    saves = list(plan.saves)

    def save(out: ModelRunnerOutput, latest: bool) -> None:
        for s in saves:
            out.kv_saved[s.key] = gather_rows(caches, s.block_ids, block_size, s.num_tokens,
                                              tables, s.group_block_ids)
    return save
