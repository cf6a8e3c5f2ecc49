"""A step's KV connector work for the model runner (prefill/decode disaggregation,
shoal/kv_transfer): rows of another engine's KV to write into a request's blocks before the
forward pass, and a finished prompt's rows to read out after it. Plain data: it travels in
the SchedulerOutput, to tensor-parallel ranks as msgpack."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class KVLayout:
    """What a transferred KV payload holds (kv_transfer/payload.py): every layer's rows one
    after another, layer i as [planes, num_tokens, heads, width in bytes] raw bytes."""

    dtype: str  # the cache dtype, as torch names it without "torch." (e.g. "bfloat16")
    num_tokens: int
    layers: list[list[int]]  # per layer [planes, num_tokens, heads, width in bytes]

    def layer_nbytes(self, i: int) -> int:
        planes, n, heads, width = self.layers[i]
        return planes * n * heads * width

    @property
    def nbytes(self) -> int:
        return sum(self.layer_nbytes(i) for i in range(len(self.layers)))

    def to_wire(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "num_tokens": self.num_tokens, "layers": self.layers}

    @classmethod
    def from_wire(cls, msg: Any) -> KVLayout:
        """From a peer's header; ValueError when it is malformed."""
        try:
            layers = [[int(x) for x in shape] for shape in msg["layers"]]
            layout = cls(str(msg["dtype"]), int(msg["num_tokens"]), layers)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a malformed KV layout ({type(e).__name__}: {e})") from e
        if any(len(s) != 4 or min(s) < 0 for s in layers) or layout.num_tokens < 0:
            raise ValueError("a malformed KV layout: each layer needs 4 sizes >= 0")
        return layout


@dataclass
class KVLoad:
    """Write rows [start, start + num_tokens) of a fetched payload (kv_transfer/payload.py:
    its layout and raw bytes) into the request's blocks."""

    serial: int
    block_ids: list[int]
    start: int
    num_tokens: int
    layout: KVLayout
    data: Any  # a buffer (memoryview: msgpack sends it to tensor-parallel ranks as bytes)


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
