"""KVCacheManager: block tables, prefix-cache lookups, all-or-nothing allocation, and a seeded
stress run that checks ref counts, the free queue and the content of every cache hit."""

from __future__ import annotations

import random

import pytest

from shoal.core.request import Request
from shoal.kv_cache.block_pool import KVBlock
from shoal.kv_cache.manager import KVCacheManager
from shoal.sampling_params import SamplingParams

BS = 4


def make_req(rid: str, prompt: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=16), frozenset(), 16,
                   cache_salt=salt)


def run_prefill(kv: KVCacheManager, req: Request) -> None:
    """Admits `req` with its prefix hits and computes the rest of its tokens in one step."""
    hits, n_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - n_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens


def queue_ids(kv: KVCacheManager) -> list[int]:
    return [b.block_id for b in kv.pool.free_queue]


def snapshot(kv: KVCacheManager) -> tuple:
    return (
        queue_ids(kv),
        [b.ref_cnt for b in kv.pool.blocks],
        [b.block_hash for b in kv.pool.blocks],
        {h: b.block_id for h, b in kv.pool.cached.items()},
        {rid: [b.block_id for b in bl] for rid, bl in kv.req_blocks.items()},
        kv.pool.num_evictions,
    )


def test_allocate_exact_block_counts_incrementally() -> None:
    kv = KVCacheManager(16, BS)
    req = make_req("a", list(range(5)))
    new = kv.allocate_slots(req, 5)
    assert new is not None and len(new) == 2
    req.num_computed_tokens = 5
    for n_tokens, expect_new in [(6, 0), (7, 0), (8, 0), (9, 1), (10, 0)]:
        req.append_output_token(n_tokens)
        new = kv.allocate_slots(req, 1)
        assert new is not None and len(new) == expect_new, n_tokens
        req.num_computed_tokens += 1
        assert len(kv.block_ids("a")) == -(-n_tokens // BS)
    assert kv.num_free_blocks == 16 - 3


def test_allocate_publishes_only_full_blocks() -> None:
    kv = KVCacheManager(16, BS)
    req = make_req("a", list(range(10)))
    blocks = kv.allocate_slots(req, 10)
    assert blocks is not None
    assert [b.block_hash is not None for b in blocks] == [True, True, False]
    assert set(kv.pool.cached) == set(req.block_hashes[:2])


def test_free_is_tail_first() -> None:
    kv = KVCacheManager(8, BS)
    req = make_req("a", list(range(12)))
    run_prefill(kv, req)
    ids = kv.block_ids("a")
    assert ids == [0, 1, 2]
    kv.free(req)
    assert kv.block_ids("a") == []
    assert queue_ids(kv)[-3:] == [2, 1, 0]
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    # The tail of the prefix goes first: allocating the 5 other free blocks plus one more
    # evicts block 2 (the prefix's last block) and keeps the head cached.
    other = make_req("b", list(range(100, 124)))
    assert kv.allocate_slots(other, 24) is not None
    assert kv.block_ids("b") == [3, 4, 5, 6, 7, 2]
    assert kv.pool.get_cached_block(req.block_hashes[0]) is kv.pool.blocks[0]
    assert kv.pool.get_cached_block(req.block_hashes[1]) is kv.pool.blocks[1]
    assert kv.pool.get_cached_block(req.block_hashes[2]) is None


@pytest.mark.parametrize(("n_tokens", "expect_blocks"), [(12, 2), (13, 3), (14, 3), (11, 2), (4, 0),
                                                         (5, 1), (3, 0)])
def test_get_computed_blocks_leaves_one_token_to_compute(n_tokens: int, expect_blocks: int) -> None:
    kv = KVCacheManager(16, BS)
    prompt = list(range(50, 66))  # 4 full blocks, all cached
    run_prefill(kv, make_req("a", prompt))
    req = make_req("b", prompt[:n_tokens])
    hits, n_hit = kv.get_computed_blocks(req)
    assert len(hits) == expect_blocks
    assert n_hit == expect_blocks * BS
    assert n_hit < req.num_tokens
    assert [b.block_id for b in hits] == kv.block_ids("a")[:expect_blocks]


def test_get_computed_blocks_stops_at_first_miss() -> None:
    kv = KVCacheManager(16, BS)
    prompt = list(range(16))
    run_prefill(kv, make_req("a", prompt))
    changed = list(prompt) + [99]
    changed[5] = 1000  # second block differs
    hits, n_hit = kv.get_computed_blocks(make_req("b", changed))
    assert [b.block_id for b in hits] == [kv.block_ids("a")[0]]
    assert n_hit == BS


def test_get_computed_blocks_does_not_change_pool_state() -> None:
    kv = KVCacheManager(16, BS)
    a = make_req("a", list(range(16)))
    run_prefill(kv, a)
    kv.free(a)
    before = snapshot(kv)
    hits, _ = kv.get_computed_blocks(make_req("b", list(range(17))))
    assert len(hits) == 4
    assert snapshot(kv) == before


def test_cache_hit_of_free_blocks_takes_them_out_of_free_queue() -> None:
    kv = KVCacheManager(8, BS)
    a = make_req("a", list(range(9)))
    run_prefill(kv, a)
    a_ids = kv.block_ids("a")
    kv.free(a)
    assert kv.num_free_blocks == 8
    b = make_req("b", list(range(9)))
    hits, n_hit = kv.get_computed_blocks(b)
    assert n_hit == 8
    new = kv.allocate_slots(b, 1, hits)
    assert new is not None and len(new) == 1
    assert kv.block_ids("b")[:2] == a_ids[:2]
    assert all(kv.pool.blocks[i].ref_cnt == 1 for i in kv.block_ids("b"))
    assert not set(kv.block_ids("b")) & set(queue_ids(kv))
    assert kv.num_free_blocks == 8 - 3
    assert kv.usage() == pytest.approx(3 / 8)


def test_shared_prefix_ref_counts() -> None:
    kv = KVCacheManager(16, BS)
    a = make_req("a", list(range(9)))
    run_prefill(kv, a)
    b = make_req("b", list(range(8)) + [77, 78])
    run_prefill(kv, b)
    shared = kv.block_ids("a")[:2]
    assert kv.block_ids("b")[:2] == shared
    assert [kv.pool.blocks[i].ref_cnt for i in shared] == [2, 2]
    assert kv.usage() == pytest.approx(4 / 16)  # 2 shared + 1 own each
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in shared] == [1, 1]
    assert not set(shared) & set(queue_ids(kv))
    kv.free(b)
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    assert kv.num_free_blocks == 16


def test_allocate_slots_none_when_short_and_state_unchanged() -> None:
    kv = KVCacheManager(6, BS)
    a = make_req("a", list(range(12)))
    run_prefill(kv, a)  # 3 blocks
    before = snapshot(kv)
    b = make_req("b", list(range(100, 116)))  # 4 blocks, 3 free
    assert kv.allocate_slots(b, 16) is None
    assert snapshot(kv) == before
    assert "b" not in kv.req_blocks and kv.block_ids("b") == []
    # Growing a running request past the pool fails the same way.
    a.append_output_token(5)
    assert kv.allocate_slots(a, 13) is None  # would need 4 more
    assert snapshot(kv) == before
    assert kv.allocate_slots(a, 1) is not None


def test_evictable_hits_count_against_free_blocks() -> None:
    kv = KVCacheManager(4, BS)
    a = make_req("a", list(range(9)))
    run_prefill(kv, a)  # 3 blocks, 2 cached
    kv.free(a)
    c = make_req("c", list(range(200, 204)))
    run_prefill(kv, c)  # takes the one uncached block
    before = snapshot(kv)
    # b hits a's 2 cached (free) blocks and needs 2 new: 4 > 3 free.
    b = make_req("b", list(range(8)) + [50, 51, 52, 53, 54])
    hits, n_hit = kv.get_computed_blocks(b)
    assert len(hits) == 2 and n_hit == 8
    assert kv.allocate_slots(b, 5, hits) is None
    assert snapshot(kv) == before
    # One new block fits: 2 hits + 1 = 3 free.
    b2 = make_req("b2", list(range(8)) + [50])
    hits, n_hit = kv.get_computed_blocks(b2)
    assert kv.allocate_slots(b2, 1, hits) is not None
    assert kv.num_free_blocks == 0


def test_caching_disabled_no_hits_and_no_publication() -> None:
    kv = KVCacheManager(8, BS, enable_caching=False)
    a = make_req("a", list(range(9)))
    run_prefill(kv, a)
    assert kv.pool.cached == {}
    assert kv.get_computed_blocks(make_req("b", list(range(9)))) == ([], 0)


def test_cache_salt_isolates_requests() -> None:
    kv = KVCacheManager(16, BS)
    run_prefill(kv, make_req("a", list(range(9)), salt="alice"))
    assert kv.get_computed_blocks(make_req("b", list(range(9)), salt="bob"))[1] == 0
    assert kv.get_computed_blocks(make_req("c", list(range(9))))[1] == 0
    assert kv.get_computed_blocks(make_req("d", list(range(9)), salt="alice"))[1] == 8


def test_prefix_counters() -> None:
    kv = KVCacheManager(16, BS)
    run_prefill(kv, make_req("a", list(range(9))))
    kv.get_computed_blocks(make_req("b", list(range(10))))
    assert kv.prefix_queries == 9 + 10
    assert kv.prefix_hits == 8


def test_reset_prefix_cache() -> None:
    kv = KVCacheManager(8, BS)
    a = make_req("a", list(range(9)))
    run_prefill(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_req("b", list(range(9)))) == ([], 0)


# ---- randomized stress -----------------------------------------------------------------------


class Sim:
    """Drives the manager like a scheduler would and mirrors the KV content of every block, so
    a prefix-cache hit whose content differs from the request's tokens is caught."""

    def __init__(self, kv: KVCacheManager, rng: random.Random):
        self.kv = kv
        self.rng = rng
        self.content: dict[int, list[tuple[str | None, int] | None]] = {}
        self.active: dict[str, Request] = {}

    def _write(self, req: Request, start: int, n: int) -> None:
        blocks = self.kv.req_blocks[req.request_id]
        for pos in range(start, start + n):
            blk = blocks[pos // BS]
            self.content[blk.block_id][pos % BS] = (req.cache_salt, req.all_token_ids[pos])

    def _fresh(self, new: list[KVBlock]) -> None:
        for b in new:  # a newly allocated block holds nothing we can rely on
            self.content[b.block_id] = [None] * BS

    def admit(self, req: Request) -> bool:
        hits, n_hit = self.kv.get_computed_blocks(req)
        assert n_hit == len(hits) * BS < req.num_tokens
        for i, b in enumerate(hits):
            want = [(req.cache_salt, t) for t in req.all_token_ids[i * BS:(i + 1) * BS]]
            assert self.content[b.block_id] == want, "prefix-cache hit with wrong content"
        n = self.rng.randint(1, req.num_tokens - n_hit)
        before = snapshot(self.kv)
        new = self.kv.allocate_slots(req, n, hits)
        if new is None:
            assert snapshot(self.kv) == before
            return False
        self._fresh(new)
        self._write(req, n_hit, n)
        req.num_computed_tokens = n_hit + n
        self.active[req.request_id] = req
        return True

    def advance(self, req: Request) -> None:
        if req.num_computed_tokens == req.num_tokens:
            req.append_output_token(self.rng.randint(0, 3))  # small vocab: shared continuations
        n = self.rng.randint(1, req.num_tokens - req.num_computed_tokens)
        before = snapshot(self.kv)
        new = self.kv.allocate_slots(req, n)
        if new is None:
            assert snapshot(self.kv) == before
            return
        self._fresh(new)
        self._write(req, req.num_computed_tokens, n)
        req.num_computed_tokens += n

    def free(self, req: Request) -> None:
        self.kv.free(req)
        del self.active[req.request_id]

    def check(self) -> None:
        pool = self.kv.pool
        held: dict[int, int] = {}
        for rid, blocks in self.kv.req_blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), "a block appears twice in one table"
            req = self.active[rid]
            assert len(ids) == -(-req.num_computed_tokens // BS), "tables are allocated tightly"
            for i in ids:
                held[i] = held.get(i, 0) + 1
        for b in pool.blocks:
            assert b.ref_cnt == held.get(b.block_id, 0)
        free_ids = [b.block_id for b in pool.free_queue]
        assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
        assert set(free_ids) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        for h, b in pool.cached.items():
            assert b.block_hash == h
        assert self.kv.usage() == pytest.approx(len(held) / pool.num_blocks)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_stress(seed: int) -> None:
    rng = random.Random(seed)
    kv = KVCacheManager(48, BS)
    sim = Sim(kv, rng)
    bases = [[rng.randint(0, 50) for _ in range(rng.randint(8, 30))] for _ in range(4)]
    salts = [None, None, "t1"]
    next_id = 0
    for _ in range(600):
        r = rng.random()
        if r < 0.3 and len(sim.active) < 10:
            base = rng.choice(bases)
            prompt = base[: rng.randint(1, len(base))] + [rng.randint(0, 50)
                                                          for _ in range(rng.randint(0, 6))]
            req = make_req(f"r{next_id}", prompt, rng.choice(salts))
            next_id += 1
            sim.admit(req)
        elif r < 0.8 and sim.active:
            sim.advance(rng.choice(list(sim.active.values())))
        elif sim.active:
            sim.free(rng.choice(list(sim.active.values())))
        sim.check()
    for req in list(sim.active.values()):
        sim.free(req)
    sim.check()
    assert kv.req_blocks == {}
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.num_free_blocks == kv.pool.free_queue.num_free == 48
    assert sorted(b.block_id for b in kv.pool.free_queue) == list(range(48))
    assert kv.usage() == 0.0
    # The run did exercise prefix reuse and eviction.
    assert kv.prefix_hits > 0
    assert kv.pool.num_evictions > 0
