"""Per-request block tables on top of the block pool, with prefix-cache lookups.

One pool of block ids serves every KV cache group (shoal/core/kv_cache_spec.py); each group
keeps its own table per request (kv_cache/block_tables.py). The first group's tables are the
request's `block_ids` (what the drafters and the KV tiers follow); the others travel as
`group_block_ids`. Allocation is all or nothing across the groups. A group whose spec holds
pages in some blocks only (holds_block: DeepSeek-V4's entries of groups longer than a block)
gets sparse tables, its other entries left null as dropped ones are.

Groups sized with a partition each (KVCacheGroup.num_blocks: layers whose rows differ,
shoal/worker/kv_pool_split.py) allocate from their own run of the pool's ids: a group's
blocks are counted against its own free blocks, and the tables hold its pages (the null
block is page 0). Block ids stay unique across the groups, so what names blocks by id (the
prefix cache, fault zeroing, KV events) is unchanged."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from shoal.core.kv_cache_spec import FULL_ATTENTION, KVCacheGroup, pool_partitions
from shoal.core.request import Request
from shoal.kv_cache.block_pool import BlockPool, KVBlock
from shoal.kv_cache.block_tables import BlockTables
from shoal.kv_cache.hashing import BlockHash, hash_full_blocks


class _Tables(BlockTables):
    """A group's tables as the manager grows them: every entry holds a block."""

    def covers(self, index: int, block_hash: BlockHash) -> bool:
        """Whether a prefix hit has what entry `index` needs."""
        return self.cached(block_hash) is not None

    def missing(self, rid: str, need: int, num_hits: int) -> int:
        """New blocks the table takes to reach `need` entries after num_hits hits."""
        return max(0, need - self.held(rid) - num_hits)

    def grow(self, rid: str, hits: list[KVBlock | None], new_blocks: list[KVBlock],
             need: int) -> None:
        self.extend(rid, hits, new_blocks)


class _SparseTables(_Tables):
    """Tables whose entries hold a block only where the spec says (holds_block); the others
    are None (the null block), need nothing from a prefix hit and take nothing new."""

    def _holds(self, index: int) -> bool:
        return self.group.spec.holds_block(index, self.block_size)

    def covers(self, index: int, block_hash: BlockHash) -> bool:
        return not self._holds(index) or self.cached(block_hash) is not None

    def hits(self, hashes: list[BlockHash], num_blocks: int,
             first: int = 0) -> list[KVBlock | None] | None:
        out: list[KVBlock | None] = [None] * first
        for i in range(first, num_blocks):
            block = self.cached(hashes[i]) if self._holds(i) else None
            if block is None and self._holds(i):
                return None  # a block it needs is not cached
            out.append(block)
        return out

    def missing(self, rid: str, need: int, num_hits: int) -> int:
        return sum(map(self._holds, range(self.held(rid) + num_hits, need)))

    def grow(self, rid: str, hits: list[KVBlock | None], new_blocks: list[KVBlock],
             need: int) -> None:
        blocks = self.blocks.setdefault(rid, [])
        ids = self.ids.setdefault(rid, [])
        start, fresh = len(blocks), iter(new_blocks)
        for i in range(start, need):
            if i - start < len(hits):
                b = hits[i - start]
            else:
                b = next(fresh) if self._holds(i) else None
            blocks.append(b)
            ids.append(self.page(b))


def _tables(group: KVCacheGroup, index: int, pool: BlockPool, block_size: int,
            null_block: int, runs: tuple[tuple[int, int], ...]) -> _Tables:
    # the first group's tables are every request's block_ids: they stay whole
    sparse = index > 0 and not group.spec.holds_every_block(block_size)
    part, base = (index, runs[index][0] - 1) if runs else (0, 0)
    return (_SparseTables if sparse else _Tables)(group, index, pool, block_size, null_block,
                                                  part, base)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 groups: Sequence[KVCacheGroup] = FULL_ATTENTION):
        """num_blocks: the shared pool's blocks; ignored when the groups have partitions of
        their own (pool_partitions)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        runs = pool_partitions(tuple(groups))
        if runs:
            self.pool = BlockPool(sum(n for _, n in runs), enable_caching, runs)
            self.null_block = 0  # every group's page 0
        else:
            self.pool = BlockPool(num_blocks, enable_caching)
            self.null_block = num_blocks  # read where a table holds no block (see BlockTables)
        self.tables = [_tables(g, i, self.pool, block_size, self.null_block, runs)
                       for i, g in enumerate(groups)]
        self._main = self.tables[0]
        self._sliding_tables = [t for t in self.tables if t.sliding]
        self._state_tables = [t for t in self.tables if t.publishes_computed]
        # Prefix-cache counters (queries and hits in tokens), read by metrics.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def req_blocks(self) -> dict[str, list[KVBlock | None]]:
        """The first group's blocks by request id (live lists)."""
        return self._main.blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def num_state_blocks(self) -> int:
        """Blocks the linear-state tables hold (live states, and a prompt chunk's block-end
        snapshots until its next step)."""
        return sum(len(blocks) - t.num_dropped.get(rid, 0) for t in self._state_tables
                   for rid, blocks in t.blocks.items())

    @property
    def state_bytes_per_request(self) -> int:
        """A request's recurrent state across every linear-attention layer."""
        return sum(t.group.spec.state_bytes * len(t.group.layers) for t in self._state_tables)

    def _update_hashes(self, request: Request) -> None:
        if self.enable_caching and len(request.all_token_ids) // self.block_size > len(
                request.block_hashes):
            request.block_hashes = hash_full_blocks(
                request.all_token_ids, self.block_size, request.block_hashes, request.hash_extra,
                request.mm_features)

    def get_computed_blocks(self, request: Request,
                            count: bool = True) -> tuple[list[KVBlock | None], int]:
        """The first group's cached blocks of the longest prefix every group holds (a
        sliding group: the blocks its window needs), and its length in tokens. At least one
        token is always left to compute, since the last position's logits are needed. `count`
        adds the query to the prefix-cache counters (not for a request asking again after
        waiting for its KV from a tier: its query was counted the first time)."""
        if not self.enable_caching:
            return [], 0
        self._update_hashes(request)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        hits = (self._window_hits(hashes) if self._sliding_tables
                else self._full_attention_hits(hashes))
        n = len(hits)
        if count:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += n * self.block_size
        return hits, n * self.block_size

    def _full_attention_hits(self, hashes: list) -> list[KVBlock | None]:
        """The leading run of blocks every group has cached (one lookup each)."""
        hits: list[KVBlock | None] = []
        for h in hashes:
            block = self._main.cached(h)
            if block is None:
                break
            hits.append(block)
        n = len(hits)
        for t in self.tables[1:]:
            n = next((i for i in range(n) if not t.covers(i, hashes[i])), n)
        return hits[:n]

    def _window_hits(self, hashes: list) -> list[KVBlock | None]:
        """With sliding-window groups: the first group's blocks of the longest prefix every
        group can start from (a sliding group needs only the blocks its window reads)."""
        # running[g][i]: cached blocks of group g among its first i
        running = []
        for t in self.tables:
            counts = [0]
            for i, h in enumerate(hashes):
                counts.append(counts[-1] + t.covers(i, h))
            running.append(counts)
        for n in range(len(hashes), 0, -1):
            if all(c[n] - c[first] == n - first for t, c in zip(self.tables, running)
                   for first in (t.group.first_needed_block(n * self.block_size,
                                                            self.block_size),)):
                first = self._main.group.first_needed_block(n * self.block_size,
                                                            self.block_size)
                return self._main.hits(hashes, n, first) or []
        return []

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed: list[KVBlock | None] | None = None,
                       loaded_blocks: int = 0, loaded_tokens: int = 0
                       ) -> list[KVBlock] | None:
        """Reserves room for `num_new_tokens` more tokens after the request's computed ones
        and its new prefix hits (new_computed, from get_computed_blocks). Returns the first
        group's new blocks, or None (and changes nothing) when the pool cannot provide them.
        loaded_blocks: the first new tokens are that many whole blocks loaded from the KV
        tiers: a linear-state table then starts at the last of them (the state loaded there),
        its entries before left empty as if they had left its one-token window, and a
        sliding table at the first block its window reads after them (only those load).
        loaded_tokens: the first new tokens are that many rows another engine's KV writes in
        (shoal/kv_transfer), a sliding group's only those its window reads after them: its
        table takes no block before them, and the block they start inside is kept out of the
        prefix cache (its earlier rows stay unwritten)."""
        rid = request.request_id
        start = request.num_computed_tokens
        if not new_computed:
            # Fast path, most decode steps: the tokens fit in the blocks already held.
            held = self._main.blocks.get(rid)
            total = start + num_new_tokens
            if held and total <= len(held) * self.block_size:
                if self.enable_caching and (total // self.block_size > (
                        self._main.num_published.get(rid, 0)) or self._states_lag(rid, start)):
                    self._publish(request, total)
                for t in self._sliding_tables:
                    t.drop_out_of_window(rid, start)
                return []
        n_hits = len(new_computed or ())
        start += n_hits * self.block_size
        # Entries this step no longer reads leave first (a state table's once published):
        # their blocks may serve this very allocation (a state table then holds at most the
        # block it reads and those its chunk reaches, what admission counts).
        if self.enable_caching and self._state_tables:
            self._update_hashes(request)
            for t in self._state_tables:
                t.publish(request, start)
        for t in self._sliding_tables:
            t.drop_out_of_window(rid, start)
        need = -(-(start + num_new_tokens) // self.block_size)
        hits = [new_computed or [] if t is self._main else
                [None] * (n_hits + loaded_blocks - 1) if loaded_blocks and t.publishes_computed
                else self._group_hits(t, request, n_hits) for t in self.tables]
        if any(h is None for h in hits):
            return None  # another group's hit left the cache meanwhile
        loaded = loaded_blocks * self.block_size + loaded_tokens
        if loaded:  # (a linear-state table's hits above already start at its loaded state)
            hits = [self._loaded_window(t, rid, h, start + loaded) if t.sliding else h
                    for t, h in zip(self.tables, hits)]
        first_new = [t.held(rid) + len(h) for t, h in zip(self.tables, hits)]
        counts = [t.missing(rid, need, len(h)) for t, h in zip(self.tables, hits)]
        # Cache hits sitting in the free queue are taken out of it, so they count against it
        # (each run of a partitioned pool against its own).
        wanted = [0] * len(self.pool.free_queues)
        for t, n in zip(self.tables, counts):
            wanted[t.part] += n
        for h in hits:
            for b in h:
                if b is not None and b.ref_cnt == 0:
                    wanted[b.part] += 1
        if any(n > self.pool.num_free(p) for p, n in enumerate(wanted)):
            return None
        # Every group's hits are taken before any group allocates: a hit still in the free
        # queue must not be handed out (and evicted) as another group's new block.
        for h in hits:
            self.pool.touch([b for b in h if b is not None])
        new_main: list[KVBlock] = []
        for t, h, n in zip(self.tables, hits, counts):
            new_blocks = self.pool.allocate(n, t.part)
            t.grow(rid, h, new_blocks, need)
            if t is self._main:
                new_main = new_blocks
        if self.enable_caching:
            self._publish(request, start + num_new_tokens)
            if loaded_tokens:
                self._withhold_partly_loaded(rid, start + loaded_tokens, first_new)
        for t in self._sliding_tables:
            t.drop_out_of_window(rid, start)
        return new_main

    def _loaded_window(self, tables: BlockTables, rid: str, hits: list[KVBlock | None],
                       end: int) -> list[KVBlock | None]:
        """A sliding table's hits when loaded rows reach `end`: None (no block) for every
        entry before the one its window then reads from."""
        first = tables.group.first_needed_block(end, self.block_size) - tables.held(rid)
        if first <= 0:
            return hits
        return [None] * first + hits[first:]

    def _withhold_partly_loaded(self, rid: str, end: int, first_new: list[int]) -> None:
        """The new block a sliding table's loaded rows start inside (before `end`'s window,
        its rows are not loaded) leaves the prefix cache, which would serve it whole."""
        for t, first in zip(self.tables, first_new):
            if not t.sliding:
                continue
            token = t.group.spec.first_needed_token(end)
            index = token // self.block_size
            blocks = t.blocks.get(rid, [])
            if token % self.block_size and first <= index < len(blocks) \
                    and blocks[index] is not None:
                self.pool.uncache_block(blocks[index])

    def _states_lag(self, rid: str, computed: int) -> bool:
        """A linear-state table has computed blocks not yet published (they publish a step
        after the attention tables: see BlockTables)."""
        n = computed // self.block_size
        return any(t.num_published.get(rid, 0) < n for t in self._state_tables)

    def _group_hits(self, tables: BlockTables, request: Request,
                    n: int) -> list[KVBlock | None] | None:
        if not n:
            return []
        first = tables.group.first_needed_block(n * self.block_size, self.block_size)
        return tables.hits(request.block_hashes, n, first)

    def _publish(self, request: Request, num_tokens: int) -> None:
        self._update_hashes(request)
        for t in self.tables:
            t.publish(request, num_tokens)
        if self.pool.events is not None:  # the stored blocks' parent and tokens
            self.pool.events.attribute(request)

    def trim(self, request: Request) -> None:
        """Speculative decoding: returns the blocks past the request's computed tokens (they
        held only rejected drafts) to the pool. None of them is in the prefix cache: hashes
        cover accepted tokens only."""
        keep = -(-request.num_computed_tokens // self.block_size)
        for t in self.tables:
            t.trim(request.request_id, keep)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's first-group block table (a live list: it grows as the request
        does)."""
        return self._main.ids.get(request_id, [])

    def block_at(self, request_id: str, group: int, index: int) -> KVBlock | None:
        """The block at one entry of the request's table of a group."""
        return self.tables[group].blocks[request_id][index]

    def group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The tables of the other groups (live lists; empty for a model of one group)."""
        return tuple(t.ids.get(request_id, []) for t in self.tables[1:])

    def request_blocks(self, request_id: str) -> Iterator[tuple[int, KVBlock]]:
        """(index in its table, block) of every block the request holds, in every group."""
        for t in self.tables:
            for i, b in enumerate(t.blocks.get(request_id, ())):
                if b is not None:
                    yield i, b

    def free(self, request: Request, failed: bool = False) -> None:
        """Returns a request's blocks to the pool. Blocks published for a step that never
        ran (a victim un-scheduled by preemption) hold no keys, and a failed request's keys are
        not to be trusted: both are withdrawn from the prefix cache unless another request
        holds them."""
        first_unsure = 0 if failed else request.num_computed_tokens // self.block_size
        if not failed and self.enable_caching and self._state_tables:
            # the states its last step computed (state tables publish a step late)
            self._update_hashes(request)
            for t in self._state_tables:
                t.publish(request, request.num_computed_tokens)
        for t in self.tables:
            t.free(request.request_id, first_unsure)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
