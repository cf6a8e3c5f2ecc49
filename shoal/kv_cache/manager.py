"""Per-request block tables on top of the block pool, with prefix-cache lookups."""

from __future__ import annotations

from shoal.core.request import Request
from shoal.kv_cache.block_pool import BlockPool, KVBlock
from shoal.kv_cache.hashing import hash_full_blocks


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_block_ids: dict[str, list[int]] = {}  # the same tables as ids, kept in step
        # How many leading blocks of each request are already published in the prefix cache,
        # so each step publishes only the newly filled ones.
        self.num_published: dict[str, int] = {}
        # Prefix-cache counters (queries and hits in tokens), read by metrics.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def _update_hashes(self, request: Request) -> None:
        if self.enable_caching and len(request.all_token_ids) // self.block_size > len(
                request.block_hashes):
            request.block_hashes = hash_full_blocks(
                request.all_token_ids, self.block_size, request.block_hashes, request.cache_salt
            )

    def get_computed_blocks(self, request: Request,
                            count: bool = True) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks at the start of the request. At least one token is
        always left to compute, since the last position's logits are needed. `count` adds the
        query to the prefix-cache counters (not for a request asking again after waiting for
        its KV from a tier: its query was counted the first time)."""
        if not self.enable_caching:
            return [], 0
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(h)
            if block is None:
                break
            hits.append(block)
        if count:
            self.prefix_queries += request.num_tokens
            self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def blocks_needed(self, request: Request, num_new_tokens: int,
                      new_computed: list[KVBlock] | None = None) -> int:
        have = len(self.req_blocks.get(request.request_id, ())) + len(new_computed or ())
        total = request.num_computed_tokens + len(new_computed or ()) * self.block_size
        need = -(-(total + num_new_tokens) // self.block_size)
        return max(0, need - have)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed: list[KVBlock] | None = None) -> list[KVBlock] | None:
        """Reserves room for `num_new_tokens` more tokens. Returns None (and changes nothing)
        when the pool cannot provide the blocks."""
        if not new_computed:
            # Fast path, most decode steps: the tokens fit in the blocks already held.
            held = self.req_blocks.get(request.request_id)
            total = request.num_computed_tokens + num_new_tokens
            if held is not None and total <= len(held) * self.block_size:
                if self.enable_caching and total // self.block_size > self.num_published.get(
                        request.request_id, 0):
                    self._publish(request, held, total)
                return []
        new_computed = new_computed or []
        n_new = self.blocks_needed(request, num_new_tokens, new_computed)
        # Cache hits sitting in the free queue are taken out of it, so they count against it.
        evictable_hits = sum(1 for b in new_computed if b.ref_cnt == 0)
        if n_new + evictable_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(new_computed)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks.extend(new_computed)
        new_blocks = self.pool.allocate(n_new)
        blocks.extend(new_blocks)
        ids = self.req_block_ids.setdefault(request.request_id, [])
        ids.extend(b.block_id for b in new_computed)
        ids.extend(b.block_id for b in new_blocks)
        if self.enable_caching:
            num_after = request.num_computed_tokens + len(new_computed) * self.block_size + num_new_tokens
            self._publish(request, blocks, num_after)
        return new_blocks

    def _publish(self, request: Request, blocks: list[KVBlock], num_after: int) -> None:
        """Publishes blocks that will be full once this step has run; attention writes a
        layer's keys before reading, so requests in the same step can share them."""
        self._update_hashes(request)
        n_full = min(num_after // self.block_size, len(request.block_hashes))
        rid = request.request_id
        done = self.num_published.get(rid, 0)
        for i in range(done, n_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self.num_published[rid] = max(n_full, done)

    def trim(self, request: Request) -> None:
        """Speculative decoding: returns the blocks past the request's computed tokens (they
        held only rejected drafts) to the pool. None of them is in the prefix cache: hashes
        cover accepted tokens only. The table lists shrink in place (they are live)."""
        rid = request.request_id
        blocks = self.req_blocks.get(rid)
        keep = -(-request.num_computed_tokens // self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        extra = blocks[keep:]
        del blocks[keep:]
        del self.req_block_ids[rid][keep:]
        self.pool.free(list(reversed(extra)))

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (a live list: it grows as the request does)."""
        return self.req_block_ids.get(request_id, [])

    def free(self, request: Request, failed: bool = False) -> None:
        """Returns a request's blocks to the pool. Blocks published for a step that never ran
        (a victim un-scheduled by preemption) hold no keys, and a failed request's keys are
        not to be trusted: both are withdrawn from the prefix cache unless another request
        holds them."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_block_ids.pop(request.request_id, None)
        self.num_published.pop(request.request_id, None)
        first_unsure = 0 if failed else request.num_computed_tokens // self.block_size
        for b in blocks[first_unsure:]:
            if b.block_hash is not None and b.ref_cnt == 1:
                self.pool.uncache_block(b)
        self.pool.free(list(reversed(blocks)))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
