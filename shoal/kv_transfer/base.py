"""The KV connector interface, scheduler side (torch-free), and the plan of KV loads and
saves a step hands to the model runner (plain data: it crosses to tensor-parallel ranks as
msgpack inside the SchedulerOutput).

The scheduler asks `lookup` for each waiting request it considers (after its device prefix
hits and KV-tier hits): how many more prompt tokens the connector can supply, 0 for none,
None while it is still finding out (the request waits, the others run). `admitted` says a
request took them (which blocks, from which position); `scheduled` sees every scheduled
chunk (a producer saves a prompt once its last chunk has run); `step_plan` gives the step's
loads and saves; `saved` receives the runner's saved KV; `finished` lets go of a request."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from shoal.core.kv_connector_plan import KVConnectorPlan
from shoal.core.request import Request
from shoal.kv_transfer.config import KVTransferConfig


@dataclass(frozen=True)
class EngineInfo:
    """What a connector knows of its engine."""

    block_size: int
    tensor_parallel_size: int
    model: str


class KVConnector(ABC):
    def __init__(self, config: KVTransferConfig, engine: EngineInfo):
        self.config, self.engine = config, engine

    @abstractmethod
    def lookup(self, req: Request, num_computed: int) -> int | None:
        """Tokens after the first num_computed that the connector supplies (never the
        prompt's last: it is computed to sample from); None: not known yet, ask again."""

    def admitted(self, req: Request, start: int, num_tokens: int, block_ids: list[int]) -> None:
        """The request was admitted with num_tokens of the connector's tokens from start."""
        return None

    def scheduled(self, req: Request, start: int, num_tokens: int,
                  block_ids: list[int]) -> None:
        """A chunk of the request runs this step (tokens [start, start + num_tokens))."""
        return None

    @abstractmethod
    def step_plan(self) -> KVConnectorPlan | None:
        """The loads and saves of the step being built (None: nothing)."""

    def saved(self, payloads: dict[str, bytes]) -> None:
        """The runner's saved KV of finished prompts, by KVSave.key."""
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
