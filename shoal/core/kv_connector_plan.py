"""A step's KV connector work for the model runner (prefill/decode disaggregation,
shoal/kv_transfer): rows of another engine's KV to write into a request's blocks before the
forward pass, and a finished prompt's rows to read out after it. Plain data: it travels in
the SchedulerOutput, to tensor-parallel ranks as msgpack."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVLoad:
    """Write rows [start, start + num_tokens) of an encoded payload (rows.py) into the
    request's blocks."""

    serial: int
    block_ids: list[int]
    start: int
    num_tokens: int
    payload: bytes


@dataclass
class KVSave:
    """Read the request's first num_tokens rows out of its blocks after the forward pass, and
    report them under `key` (ModelRunnerOutput.kv_saved)."""

    serial: int
    key: str
    block_ids: list[int]
    num_tokens: int


@dataclass
class KVConnectorPlan:
    loads: list[KVLoad] = field(default_factory=list)
    saves: list[KVSave] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)
