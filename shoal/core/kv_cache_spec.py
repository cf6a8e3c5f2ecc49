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
backend's methods for it. DeepSeek-V4 keeps rows its own layers read back
(shoal/layers/paged_rows.py): its window's shared K=V rows (SlidingSharedKVSpec), its
compressors' per-token inputs of the groups still pooling (CompressorStateSpec: a sliding
table over the last group or two) and the compressed entries themselves (CompressedEntrySpec:
one per group of `ratio` tokens for the whole context; a block holds its groups' entries, so
its page is a fraction of a per-token page: slot_row says how it is laid over the block's
slots; with groups longer than a block only the blocks closing a group hold one, the other
entries of its sparse tables stay the null block: holds_block). Its first version kept every
token's compressor inputs instead (CompressorInputSpec).

Groups whose layers' rows differ (DeepSeek-V4's windows, entries and open groups) would cost,
in one pool of shared block ids, every layer's page per block of any group. Such groups
instead get a pool partition each (KVCacheGroup.num_blocks, pool_partitions): a run of block
ids whose pages only that group's layers have, sized by what the group holds
(shoal/worker/kv_pool_split.py), so a token of context costs context_bytes_per_token. Every
group keeps the one block size, so tables, prefix hashes, slot mapping and the layers' reads
stay as they are; see shoal/worker/kv_pool_split.py for why this and not vLLM's per-group
block sizes."""

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

    def slot_row(self, block_size: int) -> tuple[int, int, int]:
        """(planes, heads, values) of one token slot of the layer's cache tensor: its row."""
        return self.planes, self.num_kv_heads, self.head_size

    def holds_block(self, index: int, block_size: int) -> bool:
        """Whether entry `index` of a table of this kind holds a block (else it stays the
        null block: a sparse table)."""
        return True

    def holds_every_block(self, block_size: int) -> bool:
        return True

    def held_fraction(self, block_size: int) -> float:
        """The share of a table's entries that hold a block (over a long context)."""
        return 1.0

    def bytes_per_token(self, block_size: int) -> float:
        """What a token costs while its block is held."""
        return self.page_bytes(block_size) / block_size

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
    each step, so this keeps more than the compressed cache it stands for. DeepSeek-V4's first
    version declared it; CompressedEntrySpec and CompressorStateSpec replace it (it stays as
    the measure they are compared with)."""


@dataclass(frozen=True)
class CompressorStateSpec(SlidingWindowSpec):
    """DeepSeek-V4's compressor (CSA, HCA): the per-token rows (num_kv_heads 1, head_size the
    row's width) of the tokens its next entries still pool, in sliding tables: the group in
    progress (window = ratio), and for CSA's overlapping groups the one before it (window =
    2 ratio). A step reads these rows only when it closes a group; the entries themselves
    live in CompressedEntrySpec pages."""

    @property
    def planes(self) -> int:
        return 1


@dataclass(frozen=True)
class CompressedEntrySpec(KVCacheSpec):
    """DeepSeek-V4's compressed entries (CSA, HCA): one row of head_size values (num_kv_heads
    1) per complete group of `ratio` tokens, kept for the whole context (tables that drop no
    block, as full attention's). Entry w is written once, by the step computing its group's
    last token e = (w + 1) ratio - 1, in the block holding e, so a block's page depends only
    on the tokens up to its end (what prefix caching needs). A block holds ceil(block_size / ratio)
    entry slots: block_size / ratio when ratio divides it; one when ratio > block_size, and
    then only the blocks closing a group are held (a sparse table: the KV manager leaves the
    others null). The page is laid over the block's token slots as rows of slot_row values
    (rounded up), so the pool allocates, sizes and zeroes it like any other page: a token of
    context costs head_size / ratio values (when ratio divides block_size or exceeds it).
    Each ratio has its own tables (table_kind)."""

    ratio: int = 1

    @property
    def table_kind(self) -> tuple:
        return ("entries", self.ratio)

    def holds_block(self, index: int, block_size: int) -> bool:
        # a group's last token falls in this block
        return (index + 1) * block_size // self.ratio > index * block_size // self.ratio

    def holds_every_block(self, block_size: int) -> bool:
        return self.ratio <= block_size

    def held_fraction(self, block_size: int) -> float:
        return min(1.0, block_size / self.ratio)

    def bytes_per_token(self, block_size: int) -> float:
        return self.page_bytes(block_size) / max(block_size, self.ratio)

    @property
    def planes(self) -> int:
        return 1

    def entries_per_block(self, block_size: int) -> int:
        return -(-block_size // self.ratio)

    def slot_row(self, block_size: int) -> tuple[int, int, int]:
        values = self.entries_per_block(block_size) * self.head_size
        return 1, 1, -(-values // block_size)

    def page_bytes(self, block_size: int) -> int:
        return block_size * self.slot_row(block_size)[2] * self.dtype_bytes


@dataclass(frozen=True)
class LinearStateSpec(KVCacheSpec):
    """A linear-attention layer's recurrent state per request, in float32 words: the short
    convolution's last conv_width inputs of conv_dim channels, and the [state_heads, key_dim,
    value_dim] delta-rule state. It is stored in the page of an attention layer of the same
    block id (num_kv_heads, head_size, dtype_bytes, planes: that layer's row), whose bytes must
    hold it.

    The sizes are this rank's: conv_parts cuts its conv channels into consecutive parts
    (Gated DeltaNet's and KDA's q | k | v heads; empty: one part), each this rank's slice of
    the model's part, in rank order as its state heads are, so that a state moves between
    engines of any TP sizes (kv_transfer/states.py)."""

    planes_of_page: int = 2
    conv_dim: int = 0
    conv_width: int = 0
    state_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    conv_parts: tuple[int, ...] = ()

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
    # Blocks of its own pool partition (0: the groups share the pool's block ids)
    num_blocks: int = 0

    @property
    def sliding_window(self) -> int | None:
        return self.spec.sliding_window

    @property
    def holds_state(self) -> bool:
        """Linear-attention layers: their tables hold recurrent states, not keys."""
        return isinstance(self.spec, LinearStateSpec)

    def first_needed_block(self, start: int, block_size: int) -> int:
        return self.spec.first_needed_token(start) // block_size


def _even_chunks(layers: list[int], size: int) -> list[list[int]]:
    """The layers in order, cut into the fewest runs of at most `size`, as even as can be."""
    n = -(-len(layers) // size)
    cuts = [len(layers) * i // n for i in range(n + 1)]
    return [layers[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]


def _windows_in_chunks(specs: list[KVCacheSpec], kinds: list[list[int]]) -> list[list[list[int]]]:
    """Each table kind's layers as groups. Where every layer keeps plain K/V pages of one shape
    (the groups share tensors: the j-th layer of each group shares one, so a block id costs
    the largest group's pages), a sliding kind with more layers than the full-attention kind
    is cut into groups of at most the full kind's size (vLLM's hybrid grouping). Gemma 3's 52
    sliding layers beside 10 full ones made one group of 52: each block id cost 52 pages,
    and a full-attention block used 10 of them; in six groups of 8-9 a block costs 10 pages,
    so a token of long context costs 10 layers' rows instead of 52 (at a context about the
    window's length, as W1's, 0.65x the pages a request holds)."""
    plain = all(type(s) in (FullAttentionSpec, SlidingWindowSpec) for s in specs)
    shapes = {(s.num_kv_heads, s.head_size, s.dtype_bytes) for s in specs}
    full = [idx for idx in kinds if specs[idx[0]].sliding_window is None]
    if not plain or len(shapes) != 1 or len(full) != 1:
        return [[idx] for idx in kinds]
    size = len(full[0])
    return [_even_chunks(idx, size) if specs[idx[0]].sliding_window is not None else [idx]
            for idx in kinds]


def group_layers(specs: list[KVCacheSpec], split_windows: bool = True
                 ) -> tuple[KVCacheGroup, ...]:
    """Groups layers by table kind, full-attention tables first (the drafters and the KV
    tiers follow the first group's table), then sliding ones, then linear states, each in
    order of its first layer. Linear-state layers form groups no larger than the attention
    groups (vLLM's hybrid grouping): the j-th layer of every group shares one tensor, so a
    block id costs the largest group's pages. split_windows: cut a large sliding kind into
    groups (_windows_in_chunks); off where pipeline stages group their own layers, as the
    scheduler keeps one set of groups for every stage."""
    by_kind: dict[tuple, list[int]] = {}
    for i, spec in enumerate(specs):
        by_kind.setdefault(spec.table_kind, []).append(i)
    states = by_kind.pop(("state",), [])
    kinds = list(by_kind.values())
    chunked = _windows_in_chunks(specs, kinds) if split_windows else [[k] for k in kinds]
    groups = [KVCacheGroup(specs[g[0]], tuple(g)) for chunks in chunked for g in chunks]
    size = max((len(g.layers) for g in groups), default=len(states)) or 1
    groups += [KVCacheGroup(specs[states[i]], tuple(states[i:i + size]))
               for i in range(0, len(states), size)]

    def order(g: KVCacheGroup) -> tuple:
        kind = 2 if isinstance(g.spec, LinearStateSpec) else int(g.sliding_window is not None)
        ratio = g.spec.ratio if isinstance(g.spec, CompressedEntrySpec) else 1
        # compressed entries: the densest first (the first group's table must hold every block)
        return kind, ratio, g.layers[0]
    groups.sort(key=order)
    return tuple(groups)


@dataclass(frozen=True)
class KVCacheLayout:
    """What the runner allocated: num_blocks blocks (ids [0, num_blocks); id num_blocks is the
    null block, always zero, which padding and the entries that left a table read) and the
    groups sharing them. A partitioned pool (pool_partitions): num_blocks is the first group's
    (every token of the context takes its blocks), each group has its own."""

    num_blocks: int
    groups: tuple[KVCacheGroup, ...]


def pool_partitions(groups: tuple[KVCacheGroup, ...] | list[KVCacheGroup]
                    ) -> tuple[tuple[int, int], ...]:
    """(first block id, count) of each group's run of a partitioned pool, in group order,
    ids from 1: id 0 is the null block, page 0 of every group's tensors (each group's block
    id b is its page b - first + 1). Empty when the groups share the pool."""
    if not groups or not all(g.num_blocks for g in groups):
        return ()
    runs, first = [], 1
    for g in groups:
        runs.append((first, g.num_blocks))
        first += g.num_blocks
    return tuple(runs)


def context_bytes_per_token(specs: list[KVCacheSpec], block_size: int) -> float:
    """What a token of context costs across the layers that keep every token (their pages
    over the block's tokens); the windows' and states' blocks are a bounded cost per request."""
    return sum(s.bytes_per_token(block_size) for s in specs if not s.drops_blocks)


# The one group of a model whose layers all keep every token (the KV manager's default: the
# scheduler needs only the table policy, not the shapes).
FULL_ATTENTION = (KVCacheGroup(FullAttentionSpec(1, 1, 1), (0,)),)
