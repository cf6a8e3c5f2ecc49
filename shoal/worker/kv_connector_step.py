"""The model runner's side of a step's KV connector plan (shoal/kv_transfer): loads written
into the requests' blocks before the forward pass (queued on the device: from pinned host
memory on CUDA, so the step does not wait for them), saves read out right behind the step's
forward pass (queued after it on CUDA) into one host buffer each, handed over at finish,
which the connector serves once its copies have landed. Each layer's rows follow its KV
cache group's block table (rows.LayerTables: sliding windows beside full attention; a
linear-attention layer's state in the block covering the last token; DeepSeek-V4's
compressed entries in the blocks closing their groups, kv_transfer/entries.py). A drafter
with layers of its own moves its rows too (kv_transfer/draft_rows.py): written with the
target's on load, read out at finish behind the drafter's mirror of the step on save."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from shoal.core.kv_connector_plan import KVConnectorPlan
from shoal.core.scheduler_output import ModelRunnerOutput
from shoal.distributed.parallel_state import get_tp_rank
from shoal.kv_transfer.draft_rows import DraftRows
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
              tables: LayerTables | None = None, draft: DraftRows | None = None) -> None:
    """A load's bytes come in the plan, or as a handle to shared memory where every
    tensor-parallel rank of this host maps its own link (kv_transfer/shared.py) and reads
    only its heads. (A consumer has one pipeline stage: kv_transfer/factory.py.) draft: the
    drafter's caches, which get its rows (zeros where the payload has none that fit)."""
    rank = get_tp_rank()
    buffers = [open_rows(load.data, rank) for load in plan.loads]
    for load, data in zip(plan.loads, buffers):
        scatter_rows(caches, load.layout, data, load.block_ids, block_size, load.start,
                     load.num_tokens, tables, load.group_block_ids)
        if draft is not None:
            draft.load(load.layout, data, load.block_ids, block_size, load.start,
                       load.num_tokens)
    if plan.loads and caches[0].device.type == "cuda":
        _keeper.keep(buffers)


def save_hook(plan: KVConnectorPlan, caches: list[torch.Tensor], block_size: int,
              tables: LayerTables | None = None, draft: DraftRows | None = None
              ) -> Callable[[ModelRunnerOutput, bool], None]:
    """Reads the plan's saves out now, right behind the step's forward pass (queued after it
    on CUDA): a later step, scheduled before this one finishes (async scheduling), may reuse
    a block the saves read (a linear layer's state block or a sliding layer's, dropped from
    the request's table then). With several tensor-parallel ranks each reads its own heads
    and TP rank 0 gathers them (a collective: every rank runs the same steps). The hook
    hands the payloads over at finish; with `draft` it reads the drafter's rows first, so it
    must run after the drafter's finish hook (which mirrors the step into them)."""
    saved = {s.key: (s, gather_rows(caches, s.block_ids, block_size, s.num_tokens, tables,
                                    s.group_block_ids,
                                    draft.layout(s.num_tokens) if draft is not None else None))
             for s in plan.saves}

    def save(out: ModelRunnerOutput, latest: bool) -> None:
        for s, p in saved.values():
            if draft is not None:  # (a collective too: every rank, rank 0 fills p)
                draft.save(p, s.block_ids, block_size, s.num_tokens)
        out.kv_saved.update((key, p) for key, (_, p) in saved.items() if p is not None)
    return save
