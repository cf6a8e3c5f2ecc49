"""One KV cache group's block table per request, over the pool the groups share.

Each table holds one entry per block of the request's tokens. A sliding-window group drops
the blocks that fell out of the window (the entry becomes None, its id the null block, which
reads as zeros and is masked out anyway) and gives them back to the pool. Full blocks are
published in the prefix cache under the group's own key: the content hash of the block's
prefix, tagged with the group for all but the first (two groups' blocks of one prefix hold
different layers).

A linear-state group (LinearStateSpec) drops blocks as a window of one token does; its
blocks hold the state after their last token, which the step computing that token writes.
They are published only once computed: a request sharing a block published for a step in
flight would read its state (attention blocks are safe: a layer writes keys before reading).

In a partitioned pool (kv_cache_spec.pool_partitions) a group takes blocks from its own run,
and its tables on the device hold pages of its own tensors (page): id - page_base, the null
block page 0."""

from __future__ import annotations

from shoal.core.kv_cache_spec import KVCacheGroup
from shoal.core.request import Request
from shoal.kv_cache.block_pool import BlockPool, KVBlock
from shoal.kv_cache.hashing import BlockHash


class BlockTables:
    def __init__(self, group: KVCacheGroup, index: int, pool: BlockPool, block_size: int,
                 null_block: int, part: int = 0, page_base: int = 0):
        """part: the pool's run the group allocates from; page_base: a block's page in the
        group's tensors is its id minus this (a partitioned pool, kv_cache_spec.pool_partitions;
        0 and 0 for a shared pool)."""
        self.group, self.pool, self.block_size = group, pool, block_size
        self.null_block = null_block
        self.page_base = page_base
        self.part = part
        self._tag = bytes([index]) if index else b""
        self.sliding = group.spec.drops_blocks
        self.publishes_computed = group.holds_state
        self.blocks: dict[str, list[KVBlock | None]] = {}  # by request id
        self.ids: dict[str, list[int]] = {}  # the same tables as ids, kept in step
        # Leading blocks already published in the prefix cache (each step publishes only the
        # newly filled ones), and leading entries already dropped (sliding window).
        self.num_published: dict[str, int] = {}
        self.num_dropped: dict[str, int] = {}

    def page(self, block: KVBlock | None) -> int:
        """What the request's table on the device holds for `block` (None: the null page)."""
        return self.null_block if block is None else block.block_id - self.page_base

    def key(self, block_hash: BlockHash) -> BlockHash:
        return block_hash + self._tag if self._tag else block_hash

    def cached(self, block_hash: BlockHash) -> KVBlock | None:
        return self.pool.get_cached_block(self.key(block_hash))

    def hits(self, hashes: list[BlockHash], num_blocks: int,
             first: int = 0) -> list[KVBlock | None] | None:
        """The cached blocks of the first num_blocks blocks, None before `first` (a sliding
        group needs none there); None when one of the needed blocks is not cached."""
        out: list[KVBlock | None] = [None] * first
        for h in hashes[first:num_blocks]:
            block = self.cached(h)
            if block is None:
                return None
            out.append(block)
        return out

    def held(self, rid: str) -> int:
        return len(self.blocks.get(rid, ()))

    def extend(self, rid: str, hits: list[KVBlock | None], new_blocks: list[KVBlock]) -> None:
        blocks = self.blocks.setdefault(rid, [])
        ids = self.ids.setdefault(rid, [])
        for b in hits:
            blocks.append(b)
            ids.append(self.page(b))
        blocks.extend(new_blocks)
        ids.extend(b.block_id - self.page_base for b in new_blocks)
        if hits and hits[0] is None:  # a sliding hit starts past dropped entries
            self.num_dropped[rid] = sum(b is None for b in hits)

    def publish(self, req: Request, num_tokens: int) -> None:
        """Publishes the blocks that will be full once num_tokens are computed: attention
        writes a layer's keys before reading, so requests in the same step can share them."""
        rid = req.request_id
        if self.publishes_computed:
            num_tokens = min(num_tokens, req.num_computed_tokens)
        blocks = self.blocks.get(rid, [])
        n_full = min(num_tokens // self.block_size, len(req.block_hashes), len(blocks))
        done = self.num_published.get(rid, 0)
        for i in range(done, n_full):
            if blocks[i] is not None:
                self.pool.cache_block(blocks[i], self.key(req.block_hashes[i]))
        self.num_published[rid] = max(n_full, done)

    def drop_out_of_window(self, rid: str, start: int) -> None:
        """A sliding group's step computing from `start` on: blocks wholly before the window
        of its first query leave the table (back to the pool, cached content kept)."""
        if not self.sliding or rid not in self.blocks:
            return
        first = self.group.first_needed_block(start, self.block_size)
        done = self.num_dropped.get(rid, 0)
        if first <= done:
            return
        blocks, ids = self.blocks[rid], self.ids[rid]
        first = min(first, len(blocks))
        gone = [b for b in blocks[done:first] if b is not None]
        for i in range(done, first):
            blocks[i] = None
            ids[i] = self.null_block
        self.num_dropped[rid] = first
        self.pool.free(list(reversed(gone)))

    def trim(self, rid: str, keep: int) -> None:
        """Drops the entries past the first `keep` (speculative decoding's rejected drafts;
        none of them is in the prefix cache). The lists shrink in place (they are live)."""
        blocks = self.blocks.get(rid)
        if blocks is None or len(blocks) <= keep:
            return
        extra = [b for b in blocks[keep:] if b is not None]
        del blocks[keep:]
        del self.ids[rid][keep:]
        self.pool.free(list(reversed(extra)))

    def free(self, rid: str, first_unsure: int) -> None:
        """Returns the request's blocks to the pool (last first, so a prefix's tail is evicted
        before its head). Blocks from index first_unsure on are withdrawn from the prefix
        cache unless another request holds them: they were published for a step that never
        ran, or their request failed."""
        blocks = self.blocks.pop(rid, [])
        self.ids.pop(rid, None)
        self.num_published.pop(rid, None)
        self.num_dropped.pop(rid, None)
        for b in blocks[first_unsure:]:
            if b is not None and b.block_hash is not None and b.ref_cnt == 1:
                self.pool.uncache_block(b)
        self.pool.free([b for b in reversed(blocks) if b is not None])
