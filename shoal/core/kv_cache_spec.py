"""What each kind of layer keeps in the paged KV cache (vLLM's KV cache specs), and how layers
share block tables. Plain data: the model runner declares it, the scheduler's KV manager,
the sizing of the pool, the KV tiers and the drafters read it; nothing else knows a model's
cache layout.

A spec says what one layer keeps per token (planes x KV heads x head size values) and for how
long: a full-attention or latent (MLA) layer every token of the context, a sliding-window
layer only the last `window` tokens. Layers that keep tokens alike share one block table per
request: a KV cache group. A model of one kind has one group (today's models); a hybrid
(Qwen2 or Gemma with sliding layers beside full ones) has one per kind, each with its own
tables over the one pool of block ids, and a sliding group's tables give the blocks that fell
out of the window back to the pool.

Adding a kind of cache (the recurrent state of linear-attention layers, the compressed
caches of sparse attention) is a spec class here, its table policy (what first_needed_token
says), the layer that declares it and the attention backend's methods for it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's cache: per token, `planes` rows of num_kv_heads x head_size values of
    dtype_bytes each."""

    num_kv_heads: int
    head_size: int
    dtype_bytes: int

    @property
    def planes(self) -> int:
        return 2  # a K and a V plane

    @property
    def sliding_window(self) -> int | None:
        return None

    def page_bytes(self, block_size: int) -> int:
        """The bytes of one block of this layer."""
        return self.planes * block_size * self.num_kv_heads * self.head_size * self.dtype_bytes

    @property
    def table_kind(self) -> tuple:
        """What layers sharing a block table agree on (their group's key)."""
        return ("full",)

    def first_needed_token(self, start: int) -> int:
        """The earliest token a step computing from position `start` on reads: blocks wholly
        before it may leave the table."""
        return 0


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Keys and values of every token of the context."""


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """Keys and values of the last `window` tokens: a query at p reads keys (p - window, p]."""

    window: int = 0

    @property
    def sliding_window(self) -> int | None:
        return self.window

    @property
    def table_kind(self) -> tuple:
        return ("sliding", self.window)

    def first_needed_token(self, start: int) -> int:
        return max(0, start - self.window + 1)


@dataclass(frozen=True)
class LatentAttentionSpec(KVCacheSpec):
    """Multi-head latent attention (DeepSeek MLA): one row per token of kv_lora_rank latent
    values and the rotated shared key part, for every query head (num_kv_heads 1)."""

    @property
    def planes(self) -> int:
        return 1  # (keeps every token: shares full attention's table kind)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers (indices into the model's attention layers) that share one block table per
    request; `spec` is the first one's (its table policy is theirs)."""

    spec: KVCacheSpec
    layers: tuple[int, ...]

    @property
    def sliding_window(self) -> int | None:
        return self.spec.sliding_window

    def first_needed_block(self, start: int, block_size: int) -> int:
        return self.spec.first_needed_token(start) // block_size


def group_layers(specs: list[KVCacheSpec]) -> tuple[KVCacheGroup, ...]:
    """Groups layers by table kind, full-attention tables first (the drafters and the KV
    tiers follow the first group's table), then in order of their first layer."""
    by_kind: dict[tuple, list[int]] = {}
    for i, spec in enumerate(specs):
        by_kind.setdefault(spec.table_kind, []).append(i)
    groups = [KVCacheGroup(specs[idx[0]], tuple(idx)) for idx in by_kind.values()]
    groups.sort(key=lambda g: (g.sliding_window is not None, g.layers[0]))
    return tuple(groups)


@dataclass(frozen=True)
class KVCacheLayout:
    """What the runner allocated: num_blocks blocks (ids [0, num_blocks); id num_blocks is the
    null block, always zero, which padding and the entries that left a table read) and the
    groups sharing them."""

    num_blocks: int
    groups: tuple[KVCacheGroup, ...]


# The one group of a model whose layers all keep every token (the KV manager's default: the
# scheduler needs only the table policy, not the shapes).
FULL_ATTENTION = (KVCacheGroup(FullAttentionSpec(1, 1, 1), (0,)),)
