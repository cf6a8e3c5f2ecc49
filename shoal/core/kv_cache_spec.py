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

A linear-attention layer (Gated DeltaNet, KDA) keeps no tokens but a fixed-size recurrent
state per request (LinearStateSpec): its group's table holds, at each block of the request's
tokens, the state after that block's last token (the live state sits in the block of the
last computed token, so only that entry is needed: a window of one token). The state of one
layer fills one page of an attention layer (the block size is raised until it fits: vLLM's
page-size unification), so both kinds share the pool's tensors and block ids, the KV tiers
copy states as pages, and a prefix hit restores the state of its last block.

Adding a kind of cache (the compressed caches of sparse attention) is a spec class here, its
table policy (what first_needed_token says), the layer that declares it and the attention
backend's methods for it. DeepSeek-V4's first version keeps rows its own layers read back
(shoal/layers/paged_rows.py): its window's shared K=V rows (SlidingSharedKVSpec) and the
compressors' per-token inputs (CompressorInputSpec)."""

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

    @property
    def drops_blocks(self) -> bool:
        """Whether entries before first_needed_token leave the table (back to the pool)."""
        return False

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
    def drops_blocks(self) -> bool:
        return True

    @property
    def table_kind(self) -> tuple:
        return ("sliding", self.window)

    def first_needed_token(self, start: int) -> int:
        return max(0, start - self.window + 1)


@dataclass(frozen=True)
class SlidingSharedKVSpec(SlidingWindowSpec):
    """A sliding window whose key is its value (DeepSeek-V4's shared-KV MQA): one row of
    head_size values per token (num_kv_heads 1), in the sliding tables of its window."""

    @property
    def planes(self) -> int:
        return 1


@dataclass(frozen=True)
class LatentAttentionSpec(KVCacheSpec):
    """Multi-head latent attention (DeepSeek MLA): one row per token of kv_lora_rank latent
    values and the rotated shared key part, for every query head (num_kv_heads 1)."""

    @property
    def planes(self) -> int:
        return 1  # (keeps every token: shares full attention's table kind)


@dataclass(frozen=True)
class IndexerKeySpec(LatentAttentionSpec):
    """DeepSeek Sparse Attention's indexer (V3.2): one key row of index_head_dim values per
    token (num_kv_heads 1), kept for every token beside the layer's latent row, in the same
    block tables (its own tensor: the rows differ in width)."""


@dataclass(frozen=True)
class CompressorInputSpec(LatentAttentionSpec):
    """DeepSeek-V4's compressed attention (CSA, HCA): per token the projected rows its
    compressor (and CSA's indexer) pool into one entry per group of tokens, kept for every
    token (num_kv_heads 1, head_size the row's width). The entries are recomputed from them at
    each step (shoal/layers/token_compressor.py), so this keeps more than the compressed cache
    it stands for: prefix hits, chunks and preemption need nothing else."""


@dataclass(frozen=True)
class LinearStateSpec(KVCacheSpec):
    """A linear-attention layer's recurrent state per request, in float32 words: the short
    convolution's last conv_width inputs of conv_dim channels, and the [state_heads, key_dim,
    value_dim] delta-rule state. It is stored in the page of an attention layer of the same
    block id (num_kv_heads, head_size, dtype_bytes, planes: that layer's row), whose bytes must
    hold it."""

    planes_of_page: int = 2
    conv_dim: int = 0
    conv_width: int = 0
    state_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0

    @property
    def planes(self) -> int:
        return self.planes_of_page

    @property
    def state_words(self) -> int:
        return self.conv_dim * self.conv_width + self.state_heads * self.key_dim * self.value_dim

    @property
    def state_bytes(self) -> int:
        return 4 * self.state_words

    @property
    def drops_blocks(self) -> bool:
        return True

    @property
    def table_kind(self) -> tuple:
        return ("state",)

    def first_needed_token(self, start: int) -> int:
        return max(0, start - 1)  # the state after the token before `start`


def state_block_size(state_bytes: int, page_bytes_per_token: int, multiple: int = 64) -> int:
    """The smallest block size, a multiple of `multiple` (the delta rule's chunk, so block
    ends are chunk ends), whose attention page holds a linear layer's state."""
    tokens = -(-state_bytes // page_bytes_per_token)
    return max(multiple, -(-tokens // multiple) * multiple)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers (indices into the model's attention layers) that share one block table per
    request; `spec` is the first one's (its table policy is theirs)."""

    spec: KVCacheSpec
    layers: tuple[int, ...]

    @property
    def sliding_window(self) -> int | None:
        return self.spec.sliding_window

    @property
    def holds_state(self) -> bool:
        """Linear-attention layers: their tables hold recurrent states, not keys."""
        return isinstance(self.spec, LinearStateSpec)

    def first_needed_block(self, start: int, block_size: int) -> int:
        return self.spec.first_needed_token(start) // block_size


def group_layers(specs: list[KVCacheSpec]) -> tuple[KVCacheGroup, ...]:
    """Groups layers by table kind, full-attention tables first (the drafters and the KV
    tiers follow the first group's table), then sliding ones, then linear states, each in
    order of its first layer. Linear-state layers form groups no larger than the attention
    groups (vLLM's hybrid grouping): the j-th layer of every group shares one tensor, so a
    block id costs the largest group's pages."""
    by_kind: dict[tuple, list[int]] = {}
    for i, spec in enumerate(specs):
        by_kind.setdefault(spec.table_kind, []).append(i)
    states = by_kind.pop(("state",), [])
    groups = [KVCacheGroup(specs[idx[0]], tuple(idx)) for idx in by_kind.values()]
    size = max((len(g.layers) for g in groups), default=len(states)) or 1
    groups += [KVCacheGroup(specs[states[i]], tuple(states[i:i + size]))
               for i in range(0, len(states), size)]

    def order(g: KVCacheGroup) -> tuple:
        kind = 2 if isinstance(g.spec, LinearStateSpec) else int(g.sliding_window is not None)
        return kind, g.layers[0]
    groups.sort(key=order)
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
