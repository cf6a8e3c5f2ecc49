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
    after another, layer i as [planes, rows, heads, width in bytes] raw bytes of tokens
    [starts[i], num_tokens) (rows = num_tokens - starts[i]). A sliding-window layer sends only
    the tokens its window still reads at the prompt's end; the others start at 0 (`starts`
    empty: every layer does). A linear-attention layer (its index in `states`) sends its
    recurrent state after token num_tokens - 1 instead: one row [1, 1, 1, state bytes] from
    token num_tokens - 1, the whole model's conv and delta-rule state in the model's order of
    channels and heads, whatever the producer's tensor-parallel ranks (kv_transfer/states.py).
    A compressed layer (DeepSeek-V4's entries, ratio r in `ratios`) sends its entries instead
    of token rows: [1, num_tokens // r, 1, entry bytes], entry w pooling tokens [w r, (w + 1)
    r), placed in the consumer's own blocks by index (kv_transfer/entries.py). A speculative
    drafter's layers (an MTP or EAGLE head, a draft model: their caches on the first group's
    table) travel as a layout of their own, `draft`, whose bytes follow these layers'
    (kv_transfer/draft_rows.py)."""

    dtype: str  # the cache dtype, as torch names it without "torch." (e.g. "bfloat16")
    num_tokens: int
    layers: list[list[int]]  # per layer [planes, rows, heads, width in bytes]
    starts: list[int] = field(default_factory=list)  # per layer its first token (or empty)
    states: list[int] = field(default_factory=list)  # the layers whose row is a state
    # per layer its entries' group ratio (0: token rows), or empty: no compressed layer
    ratios: list[int] = field(default_factory=list)
    draft: KVLayout | None = None  # the drafter's layers (None: the producer sent none)

    def start(self, i: int) -> int:
        return self.starts[i] if self.starts else 0

    def ratio(self, i: int) -> int:
        return self.ratios[i] if self.ratios else 0

    def layer_nbytes(self, i: int) -> int:
        planes, n, heads, width = self.layers[i]
        return planes * n * heads * width

    @property
    def own_nbytes(self) -> int:
        """The bytes of `layers` (the drafter's follow them)."""
        return sum(self.layer_nbytes(i) for i in range(len(self.layers)))

    @property
    def nbytes(self) -> int:
        return self.own_nbytes + (self.draft.nbytes if self.draft is not None else 0)

    def to_wire(self) -> dict[str, Any]:
        wire = {"dtype": self.dtype, "num_tokens": self.num_tokens, "layers": self.layers}
        if any(self.starts):
            wire["starts"] = self.starts
        if self.states:
            wire["states"] = self.states
        if any(self.ratios):
            wire["ratios"] = self.ratios
        if self.draft is not None:
            wire["draft"] = self.draft.to_wire()
        return wire

    @classmethod
    def from_wire(cls, msg: Any) -> KVLayout:
        """From a peer's header; ValueError when it is malformed."""
        try:
            layers = [[int(x) for x in shape] for shape in msg["layers"]]
            starts = [int(x) for x in msg.get("starts", ())]
            states = [int(x) for x in msg.get("states", ())]
            ratios = [int(x) for x in msg.get("ratios", ())]
            draft = cls.from_wire(msg["draft"]) if msg.get("draft") is not None else None
            layout = cls(str(msg["dtype"]), int(msg["num_tokens"]), layers, starts, states,
                         ratios, draft)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"a malformed KV layout ({type(e).__name__}: {e})") from e
        if draft is not None and (draft.num_tokens != layout.num_tokens or draft.states
                                  or any(draft.ratios) or draft.draft is not None):
            raise ValueError("a malformed KV layout: the drafter's part must hold token rows "
                             f"of the same {layout.num_tokens} tokens")
        if any(len(s) != 4 or min(s) < 0 for s in layers) or layout.num_tokens < 0:
            raise ValueError("a malformed KV layout: each layer needs 4 sizes >= 0")
        if starts and len(starts) != len(layers):
            raise ValueError(f"a malformed KV layout: {len(starts)} starts for "
                             f"{len(layers)} layers")
        if ratios and (len(ratios) != len(layers) or min(ratios) < 0):
            raise ValueError(f"a malformed KV layout: ratios {ratios} for {len(layers)} layers")
        for i, shape in enumerate(layers):
            first, ratio = layout.start(i), layout.ratio(i)
            if ratio:  # compressed entries: every complete group's, from token 0
                if first or shape[1] != layout.num_tokens // ratio:
                    raise ValueError(f"a malformed KV layout: layer {i} has {shape[1]} "
                                     f"entries of ratio {ratio} from token {first} of "
                                     f"{layout.num_tokens}")
                continue
            if not 0 <= first <= layout.num_tokens or shape[1] != layout.num_tokens - first:
                raise ValueError(f"a malformed KV layout: layer {i} has {shape[1]} rows from "
                                 f"token {first} of {layout.num_tokens}")
        if sorted(set(states)) != states or any(not 0 <= i < len(layers) for i in states):
            raise ValueError(f"a malformed KV layout: state layers {states}")
        for i in states:
            if layers[i][:2] != [1, 1] or layout.start(i) != layout.num_tokens - 1:
                raise ValueError(f"a malformed KV layout: layer {i}'s state is not one row "
                                 f"after token {layout.num_tokens - 1}")
        return layout


@dataclass
class KVLoad:
    """Write rows [start, start + num_tokens) of a fetched payload (kv_transfer/payload.py:
    its layout and raw bytes) into the request's blocks (a sliding-window layer only those
    its window reads from start + num_tokens on)."""

    serial: int
    block_ids: list[int]  # the first KV cache group's table
    start: int
    num_tokens: int
    layout: KVLayout
    data: Any  # a buffer (memoryview: msgpack sends it to tensor-parallel ranks as bytes)
    group_block_ids: list[list[int]] = field(default_factory=list)  # the other groups' tables


@dataclass
class KVSave:
    """Read the request's first num_tokens rows out of its blocks after the forward pass, and
    report them under `key` (ModelRunnerOutput.kv_saved)."""

    serial: int
    key: str
    block_ids: list[int]  # the first KV cache group's table
    num_tokens: int
    group_block_ids: list[list[int]] = field(default_factory=list)  # the other groups' tables


@dataclass
class KVConnectorPlan:
    loads: list[KVLoad] = field(default_factory=list)
    saves: list[KVSave] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)
