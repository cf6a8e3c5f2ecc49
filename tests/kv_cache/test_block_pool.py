"""BlockPool and FreeBlockQueue: LRU free order, O(1) removal, ref counts, eviction of cached
content, and the usage figure."""

from __future__ import annotations

import pytest

from shoal.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVBlock
from shoal.kv_cache.hashing import hash_block


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def h(i: int) -> bytes:
    return hash_block(None, [i, i + 1, i + 2, i + 3])


# ---- FreeBlockQueue --------------------------------------------------------------------------


def test_free_queue_starts_in_id_order_and_pops_from_head() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.num_free == 5
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4]
    assert q.popleft() is blocks[0]
    assert q.popleft() is blocks[1]
    assert q.num_free == 3
    assert [b.block_id for b in q] == [2, 3, 4]


def test_free_queue_remove_from_middle_relinks_neighbours() -> None:
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert blocks[1].next is blocks[3] and blocks[3].prev is blocks[1]
    assert blocks[2].prev is None and blocks[2].next is None
    assert q.num_free == 4
    # Head and tail removal work too.
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert [b.block_id for b in q] == [1, 3]
    # A removed block re-enters at the tail.
    q.append(blocks[2])
    assert [b.block_id for b in q] == [1, 3, 2]
    assert q.num_free == 3


def test_free_queue_remove_of_absent_block_raises() -> None:
    blocks = [KVBlock(i) for i in range(3)]
    q = FreeBlockQueue(blocks)
    b = q.popleft()
    with pytest.raises(RuntimeError):
        q.remove(b)
    assert q.num_free == 2


def test_free_queue_popleft_on_empty_raises() -> None:
    q = FreeBlockQueue([KVBlock(0)])
    q.popleft()
    with pytest.raises(ValueError):
        q.popleft()
    assert q.num_free == 0
    assert list(q) == []


def test_free_queue_remove_touches_only_neighbours() -> None:
    # O(1): removal relinks the two neighbours and never walks the list. Cut the list off from
    # both sentinels; a removal that searched from either end would fail or miss the block.
    blocks = [KVBlock(i) for i in range(1000)]
    q = FreeBlockQueue(blocks)
    head_next, tail_prev = q._head.next, q._tail.prev
    q._head.next = None
    q._tail.prev = None
    q.remove(blocks[500])
    assert blocks[499].next is blocks[501] and blocks[501].prev is blocks[499]
    q._head.next, q._tail.prev = head_next, tail_prev
    assert q.num_free == 999
    assert [b.block_id for b in q] == [i for i in range(1000) if i != 500]


# ---- BlockPool -------------------------------------------------------------------------------


def test_pool_rejects_empty() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)


def test_allocate_sets_ref_and_takes_from_head() -> None:
    pool = BlockPool(6)
    got = pool.allocate(2)
    assert [b.block_id for b in got] == [0, 1]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks == 4
    assert queue_ids(pool) == [2, 3, 4, 5]


def test_allocate_more_than_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(ValueError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert queue_ids(pool) == [3]


def test_lru_blocks_freed_first_are_reused_first() -> None:
    pool = BlockPool(6)
    a = pool.allocate(2)  # 0, 1
    b = pool.allocate(2)  # 2, 3
    pool.free(b)
    pool.free(a)
    assert queue_ids(pool) == [4, 5, 2, 3, 0, 1]
    got = pool.allocate(4)
    assert [x.block_id for x in got] == [4, 5, 2, 3]


def test_free_order_is_the_given_order() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.free(list(reversed(blocks)))
    assert queue_ids(pool) == [3, 2, 1, 0]


def test_touch_shares_a_block_and_free_drops_one_reference_at_a_time() -> None:
    pool = BlockPool(4)
    (blk,) = pool.allocate(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free([blk])
    assert blk.ref_cnt == 1
    assert blk.block_id not in queue_ids(pool)
    assert pool.num_free_blocks == 3
    pool.free([blk])
    assert blk.ref_cnt == 0
    assert queue_ids(pool)[-1] == blk.block_id
    assert pool.num_free_blocks == 4


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    (blk,) = pool.allocate(1)
    pool.free([blk])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([blk])
    assert blk.ref_cnt == 0
    assert pool.num_free_blocks == 2


def test_touch_of_free_cached_block_pulls_it_out_of_the_free_queue() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.cache_block(a[1], h(1))
    pool.free(list(reversed(a)))  # queue: 2, 3, 1, 0
    assert queue_ids(pool) == [2, 3, 1, 0]
    hit = pool.get_cached_block(h(1))
    assert hit is a[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1
    assert queue_ids(pool) == [2, 3, 0]
    assert pool.num_free_blocks == 3
    # Still cached, still the same block: not evicted by a touch.
    assert pool.get_cached_block(h(1)) is a[1]
    assert hit.block_hash == h(1)


def test_eviction_removes_hash_from_cache_map() -> None:
    pool = BlockPool(2)
    a = pool.allocate(2)
    pool.cache_block(a[0], h(0))
    pool.cache_block(a[1], h(1))
    pool.free([a[1], a[0]])  # a[1] evicted first
    assert pool.get_cached_block(h(0)) is a[0]
    assert pool.get_cached_block(h(1)) is a[1]
    (got,) = pool.allocate(1)
    assert got is a[1]
    assert got.block_hash is None
    assert pool.get_cached_block(h(1)) is None
    assert h(1) not in pool.cached
    assert pool.get_cached_block(h(0)) is a[0]
    assert pool.num_evictions == 1


def test_allocating_uncached_blocks_is_not_an_eviction() -> None:
    pool = BlockPool(3)
    pool.free(pool.allocate(3))
    pool.allocate(3)
    assert pool.num_evictions == 0


def test_cache_block_first_writer_wins() -> None:
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(7))
    pool.cache_block(b, h(7))
    assert pool.get_cached_block(h(7)) is a
    # Evicting the duplicate must not drop the map entry of the original.
    pool.free([b])
    pool.allocate(2)  # block 2, then b
    assert b.block_hash is None
    assert pool.get_cached_block(h(7)) is a


def test_cache_block_does_not_rehash_a_cached_block() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, h(1))
    pool.cache_block(a, h(2))
    assert a.block_hash == h(1)
    assert pool.get_cached_block(h(2)) is None


def test_caching_disabled_never_finds_blocks() -> None:
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.allocate(1)
    pool.cache_block(a, h(1))
    assert a.block_hash is None
    assert pool.get_cached_block(h(1)) is None
    assert pool.cached == {}


def test_usage_counts_only_held_blocks() -> None:
    pool = BlockPool(8)
    assert pool.usage() == 0.0
    a = pool.allocate(4)
    assert pool.usage() == pytest.approx(0.5)
    for i, blk in enumerate(a):
        pool.cache_block(blk, h(i))
    pool.free(a[2:])
    # Two cached blocks nobody holds count as free.
    assert pool.usage() == pytest.approx(0.25)
    pool.touch([a[0]])  # a shared block is still one block
    assert pool.usage() == pytest.approx(0.25)
    pool.free(a[:2])
    pool.free([a[0]])
    assert pool.usage() == 0.0
    assert len(pool.cached) == 4


def test_reset_prefix_cache_only_when_all_free() -> None:
    pool = BlockPool(3)
    a = pool.allocate(2)
    pool.cache_block(a[0], h(0))
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h(0)) is a[0]
    pool.free(a)
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {}
    assert all(b.block_hash is None for b in pool.blocks)
