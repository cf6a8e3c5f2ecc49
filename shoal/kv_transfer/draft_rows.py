"""A speculative drafter's KV between engines: prefill/decode disaggregation where both sides
draft with layers of their own (an MTP head: DeepSeek-V3's, V4's, Qwen3-Next's and Qwen3.5's;
an EAGLE head; a draft model).

Such a drafter keeps a paged cache of its own on the target's first block table
(spec_decode/drafter_cache.py). A hidden-state head writes its row of position p when it
mirrors the step that computed p, once token p + 1 is known (spec_decode/mtp.py); a draft
model at the step's launch. A consumer skips computing the loaded prompt tokens, so nothing
mirrors them there: without their rows its drafter attends over whatever the blocks held
(the rows of their previous owner, or zeros in a fresh pool) and its drafts, never its
tokens, go wrong. So the drafter's rows travel too:

- producer: a payload keeps room for the drafter's rows of the same tokens after the
  target's (KVLayout.draft), read out (`save`) by a finish hook that runs after the
  drafter's own, which mirrors the step's last chunk; the prompt's tokens are the producer's
  to mirror, as every engine with this drafter does. Every layer on the first table, the
  rows the target's first group keeps (its sliding window, if any), each tensor-parallel
  rank's heads gathered on rank 0 as the target's are (rows.gather_rows). They go only to
  a consumer whose fetch asks for them (p2p.py); while such a save is in flight no later
  step launches (engine/core.py, _depth), so none can reuse its blocks before the readout.
- consumer: its drafter's rows of the loaded tokens are written with the target's (`load`).
  A payload without them (the producer runs without a drafter) or with another drafter's
  (other layers, heads, widths, dtype: another speculative config) cannot warm it: its rows
  of the loaded tokens are zeroed instead, with a warning once per kind of reason, and the
  request goes on with a cold drafter. Its tokens are exact either way (verification is lossless);
  only its acceptance is lower. Recomputing the prompt instead would warm the drafter but
  throw away the transfer, the point of disaggregation; the drafter cannot be warmed from the
  target's KV alone (a head reads the target's hidden states, which nobody kept).

A head of several MTP layers (mtp_chain.py) sends each depth's rows as they are: depth j's
rows from position L - j of an L-token prompt on were never mirrored on the producer, but a
consumer's first drafting pass writes them before it reads them. With two layers nothing is
missing; with three or more the consumer's chain lacks the carry of depths 1.. (states, not
KV, which do not travel), as after a prefix-cache hit: depth j >= 2 keeps a drafting pass's
row at L - j, so drafts 3.. of a request can differ from one engine's."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import torch

from shoal.core.kv_connector_plan import KVLayout
from shoal.distributed.parallel_state import get_tp_world_size
from shoal.kv_transfer.base import KVRows
from shoal.kv_transfer.payload import KVPayload
from shoal.kv_transfer.rows import (
    LayerTables,
    gather_rows,
    layout_of,
    scatter_rows,
    token_slots,
)
from shoal.kv_transfer.tp_rows import kv_head_replicas, model_kv_heads

logger = logging.getLogger(__name__)
_warned: set[str] = set()  # the kinds of reason warned of ("none", "unfit"): once each


@dataclass
class DraftRows:
    """The drafter's paged caches (this rank's) and how they follow the first table; counts
    of loads written and loads zeroed (no fitting rows)."""

    caches: list[torch.Tensor]
    tables: LayerTables
    rows: KVRows  # this rank's rows, which a payload's drafter part must fit
    num_loaded: int = 0
    num_zeroed: int = 0

    @classmethod
    def of(cls, drafter: Any, window: int | None, hf_config: Any = None) -> DraftRows | None:
        """A drafter's (worker/drafter.py: kv_layers, bound) on the first table, whose
        sliding window is `window`; None for one without layers (ngram) or none.
        hf_config: the target's, for the KV heads of a head without a config of its own."""
        layers = drafter.kv_layers() if drafter is not None else []
        caches = [getattr(layer, "kv_cache", None) for layer in layers]
        if not caches or any(kv is None or kv.dim() != 4 for kv in caches):
            return None
        n = len(caches)
        world = get_tp_world_size()
        replicas: tuple[int, ...] = ()
        if world > 1:
            specs = [layer.kv_cache_spec(kv.element_size()) for layer, kv in zip(layers, caches)]
            config = getattr(getattr(drafter, "model", None), "config", None) or hf_config
            replicas = kv_head_replicas(specs, model_kv_heads(config), world)
        rows = KVRows(str(caches[0].dtype).removeprefix("torch."),
                      [(kv.shape[0], kv.shape[2], kv.shape[3] * kv.element_size())
                       for kv in caches], (window,) * n)
        return cls(caches, LayerTables((0,) * n, (window,) * n, replicas=replicas), rows)

    def layout(self, num_tokens: int) -> KVLayout:
        """The drafter's part of a payload of num_tokens: every KV head (TP rank 0 gathers
        the ranks' heads, as gather_rows does)."""
        starts = [self.tables.first_sent(i, num_tokens) for i in range(len(self.caches))]
        mine = layout_of(self.caches, num_tokens, starts, self.tables)
        world = get_tp_world_size()
        if world == 1:
            return mine
        return replace(mine, layers=[[p, n, h * world // rep, w] for (p, n, h, w), rep
                                     in zip(mine.layers, self.tables.replicas)])

    def save(self, payload: KVPayload | None, block_ids: list[int], block_size: int,
             num_tokens: int) -> None:
        """Reads the drafter's rows of tokens [0, num_tokens) into the room `payload` (made
        by gather_rows with draft=layout(num_tokens)) keeps after the target's; on CUDA its
        `ready` then waits for these copies too. Every tensor-parallel rank calls it (a
        collective); only rank 0 has a payload."""
        into = None
        if payload is not None:
            into = memoryview(payload.data).cast("B")[payload.layout.own_nbytes:]
        part = gather_rows(self.caches, block_ids, block_size, num_tokens, self.tables,
                           into=into)
        if payload is None or part is None:
            return
        if payload.layout.draft is None or part.layout.layers != payload.layout.draft.layers:
            raise RuntimeError(f"the drafter's rows {part.layout.layers} do not fill the "
                               f"room kept for them ({payload.layout.draft})")
        if part.ready is not None:  # (queued after the target's rows: it waits for both)
            payload.ready = part.ready

    def unfit(self, layout: KVLayout) -> str | None:
        """Why a payload's drafter part cannot go into this drafter's caches (None: it can)."""
        if layout.draft is None:
            return ("the producer sent no drafter KV (it runs without this speculative "
                    "config)")
        try:
            self.rows.check(layout.draft, get_tp_world_size())
        except ValueError as e:
            return f"the producer's drafter KV does not fit this drafter ({e})"
        return None

    def load(self, layout: KVLayout, data: Any, block_ids: list[int], block_size: int,
             start: int, num_tokens: int) -> bool:
        """Writes the payload's drafter rows of tokens [start, start + num_tokens) into the
        request's blocks, as scatter_rows does the target's; zeroes them where the payload
        has none that fit (and warns once per kind of reason). Returns whether it wrote them."""
        reason = self.unfit(layout)
        if reason is None:
            assert layout.draft is not None
            tail = memoryview(data).cast("B")[layout.own_nbytes:]
            scatter_rows(self.caches, layout.draft, tail, block_ids, block_size, start,
                         num_tokens, self.tables)
            self.num_loaded += 1
            return True
        kind = "none" if layout.draft is None else "unfit"  # (a reason holds sizes)
        if kind not in _warned:
            _warned.add(kind)
            logger.warning("disaggregated prefill: %s; the drafter starts cold on such "
                           "prompts (zeroed rows: exact tokens, fewer accepted drafts)", reason)
        self.zero(block_ids, block_size, start, start + num_tokens)
        self.num_zeroed += 1
        return False

    def zero(self, block_ids: list[int], block_size: int, start: int, end: int) -> None:
        """Zeroes the drafter's rows of tokens [start, end) that its layers read."""
        for i, kv in enumerate(self.caches):
            first = self.tables.first_read(i, start, end)
            if first < end:
                slots = token_slots(block_ids, block_size, first, end, kv.device)
                kv.view(torch.uint8).index_fill_(1, slots, 0)
