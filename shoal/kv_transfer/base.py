"""The KV connector interface, scheduler side (torch-free), and the plan of KV loads and
saves a step hands to the model runner (plain data: it crosses to tensor-parallel ranks as
msgpack inside the SchedulerOutput).

The scheduler asks `lookup` for each waiting request it considers (after its device prefix
hits and KV-tier hits): how many more prompt tokens the connector can supply, 0 for none,
None while it is still finding out (the request waits, the others run). `admitted` says a
request took them (which blocks, from which position); `scheduled` sees every scheduled
chunk (a producer saves a prompt once its last chunk has run); `step_plan` gives the step's
loads and saves; `saved` receives the runner's saved KV; `finished` lets go of a request.
`admitted` and `scheduled` get the request's block table of every KV cache group: the first
group's (block_ids) and the others' (group_block_ids, empty for a model of one group)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from shoal.core.kv_connector_plan import KVConnectorPlan, KVLayout
from shoal.core.request import Request
from shoal.kv_transfer.config import KVTransferConfig


@dataclass(frozen=True)
class KVRows:
    """The engine's paged caches: their dtype, per layer (planes, KV heads of this rank,
    bytes of one head's row; a linear-attention layer: 1, 1, its state's bytes on this rank;
    a compressed layer: 1, 1, an entry's bytes), per layer its sliding window (None, or empty
    for all: every token), the layers that hold recurrent states, and per layer its
    compressed entries' group ratio (0: token rows; empty: no compressed layer)."""

    dtype: str
    layers: list[tuple[int, int, int]]
    windows: tuple[int | None, ...] = ()
    states: tuple[int, ...] = ()
    ratios: tuple[int, ...] = ()

    def check(self, layout: KVLayout, world: int) -> None:
        """ValueError when a transferred payload cannot go into these caches."""
        if len(layout.layers) != len(self.layers):
            raise ValueError(f"the KV has {len(layout.layers)} layers, this model "
                             f"{len(self.layers)}")
        if layout.dtype != self.dtype:
            raise ValueError(f"the KV is {layout.dtype}, this cache {self.dtype}")
        if tuple(layout.states) != self.states:
            raise ValueError(f"the KV has linear-attention states in layers {layout.states}, "
                             f"this model in {list(self.states)}")
        if any(layout.ratios) or any(self.ratios):
            theirs = [layout.ratio(i) for i in range(len(self.layers))]
            if theirs != list(self.ratios or (0,) * len(self.layers)):
                raise ValueError(f"the KV has compressed entries of ratios {theirs}, this "
                                 f"model {list(self.ratios)}")
        for i, ((planes, _, total, width), (p, local, w)) in enumerate(
                zip(layout.layers, self.layers)):
            if i in self.states:  # the whole model's state, each rank takes its slices
                if (planes, total, width) != (p, 1, w * world):
                    raise ValueError(f"the linear-attention state of layer {i} ({planes} x "
                                     f"{total} x {width} bytes) does not fit this model's "
                                     f"({world} ranks of {w} bytes: 1 x 1 x {w * world})")
                continue
            if (planes, width) != (p, w) or not (
                    local * world == total or local == total or (local == 1 and total < world)):
                raise ValueError(f"the KV rows ({planes} planes, {total} heads of {width} "
                                 f"bytes) do not fit this cache's ({p}, {local} heads a "
                                 f"rank of {world}, {w} bytes)")
        n = layout.num_tokens
        for i, window in enumerate(self.windows or (None,) * len(self.layers)):
            if i in self.states:
                continue
            reads = 0 if window is None else max(0, n - window)
            if layout.start(i) > reads:  # (a producer with a shorter window on this layer)
                raise ValueError(f"the KV of layer {i} starts at token {layout.start(i)}, "
                                 f"this layer reads from token {reads}")


@dataclass(frozen=True)
class EngineInfo:
    """What a connector knows of its engine."""

    block_size: int
    tensor_parallel_size: int
    model: str
    pipeline_parallel_size: int = 1
    # receive KV into page-locked host memory (CUDA, one rank: its copies to the device
    # are then asynchronous)
    pin_memory: bool = False
    kv_rows: KVRows | None = None  # (None: not known here, checked by the runner only)
    # every rank runs on this host (the mp executor): fetched KV reaches the ranks through
    # shared memory, each reading its own heads, not inside the step's broadcast (shared.py)
    ranks_share_memory: bool = False
    # linear-attention layers (a hybrid): the KV moves with their recurrent states, up to a
    # block end of the producer (p2p.py)
    linear_states: bool = False
    # a speculative drafter with a KV cache of its own: a consumer asks for its rows too
    # (draft_rows.py); a producer sends them only to a consumer that asks
    drafter_kv: bool = False


class KVConnector(ABC):
    def __init__(self, config: KVTransferConfig, engine: EngineInfo):
        self.config, self.engine = config, engine

    @abstractmethod
    def lookup(self, req: Request, num_computed: int) -> int | None:
        """Tokens after the first num_computed that the connector supplies (never the
        prompt's last: it is computed to sample from); None: not known yet, ask again."""

    def admitted(self, req: Request, start: int, num_tokens: int, block_ids: list[int],
                 group_block_ids: tuple[list[int], ...] = ()) -> None:
        """The request was admitted with num_tokens of the connector's tokens from start."""
        return None

    def scheduled(self, req: Request, start: int, num_tokens: int, block_ids: list[int],
                  group_block_ids: tuple[list[int], ...] = ()) -> None:
        """A chunk of the request runs this step (tokens [start, start + num_tokens))."""
        return None

    @abstractmethod
    def step_plan(self) -> KVConnectorPlan | None:
        """The loads and saves of the step being built (None: nothing)."""

    def saved(self, payloads: dict[str, Any]) -> None:
        """The runner's saved KV of finished prompts (payload.KVPayload), by KVSave.key."""
        return None

    def finished(self, req: Request) -> None:
        """The request ended (or was aborted): anything held for it may go."""
        return None

    def transfer_params(self, req: Request) -> dict[str, Any] | None:
        """What the client is told with the request's final output (a producer: where a
        consumer fetches the KV)."""
        return None

    def shutdown(self) -> None:
        return None
