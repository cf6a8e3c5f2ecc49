"""Linear-attention state tables (kv_cache_spec.LinearStateSpec): grouped no larger than the
attention group, a table keeps only the block of its live state, state blocks enter the
prefix cache once computed, and a prefix hit takes every group's blocks before any group
allocates (a free hit must not be handed to another group as a new block)."""

from __future__ import annotations

import random

from shoal import SamplingParams
from shoal.config import CacheConfig, SchedulerConfig
from shoal.core.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroup,
    LinearStateSpec,
    group_layers,
    state_block_size,
)
from shoal.core.request import Request
from shoal.engine.scheduler import Scheduler
from shoal.kv_cache.manager import KVCacheManager

BS = 4
FULL = FullAttentionSpec(2, 16, 4)
STATE = LinearStateSpec(2, 16, 4, conv_dim=8, conv_width=3, state_heads=1, key_dim=4,
                        value_dim=4)
GROUPS = (KVCacheGroup(FULL, (0,)), KVCacheGroup(STATE, (1,)))


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=64), frozenset(), 64)


def _ids(kv: KVCacheManager, rid: str) -> list[list[int]]:
    return [[b.block_id for b in t.blocks.get(rid, ()) if b is not None] for t in kv.tables]


def test_state_layers_group_by_the_attention_group_size_after_attention():
    specs = [STATE, STATE, STATE, FULL, STATE, STATE, STATE, FULL]
    groups = group_layers(specs)
    assert [g.layers for g in groups] == [(3, 7), (0, 1), (2, 4), (5, 6)]
    assert [g.holds_state for g in groups] == [False, True, True, True]
    assert STATE.first_needed_token(9) == 8 and STATE.drops_blocks
    assert STATE.state_bytes == 4 * (8 * 3 + 16)
    # the smallest multiple of 64 tokens whose page holds the state
    assert state_block_size(5632, 256) == 64 and state_block_size(2_300_000, 2048) == 1152


def test_a_state_table_keeps_only_its_live_block():
    kv = KVCacheManager(32, BS, groups=GROUPS)
    req = _req("a", list(range(3, 14)))  # 11 tokens: 3 blocks
    assert kv.allocate_slots(req, 11) is not None
    req.num_computed_tokens = 11
    for t in range(6):  # decodes cross into a fourth and fifth block
        assert kv.allocate_slots(req, 1) is not None
        # the block of the state it reads and the one it writes (the same within a block)
        main, state = _ids(kv, "a")
        s = req.num_computed_tokens
        assert len(state) == (
            2 if (s - 1) // BS != s // BS else 1)
        req.num_computed_tokens += 1
        req.append_output_token(100 + t)
    assert len(_ids(kv, "a")[0]) == 5


def test_state_blocks_are_published_once_computed():
    kv = KVCacheManager(32, BS, groups=GROUPS)
    req = _req("a", list(range(3, 12)))  # 9 tokens
    kv.allocate_slots(req, 9)
    main, state = kv.tables
    assert main.num_published["a"] == 2 and state.num_published.get("a", 0) == 0
    req.num_computed_tokens = 9
    kv.allocate_slots(req, 1)  # the next step: the prompt's states are written now
    assert state.num_published["a"] == 2


def test_a_prefix_hit_takes_every_groups_blocks_before_allocating():
    kv = KVCacheManager(6, BS, groups=GROUPS)  # exactly one 9-token request's blocks
    prompt = [random.Random(0).randrange(3, 500) for _ in range(9)]
    a = _req("a", prompt)
    assert kv.allocate_slots(a, 9) is not None
    a.num_computed_tokens = 9
    kv.allocate_slots(a, 1)  # publishes the states, frees all but the live one
    kv.free(a)
    b = _req("b", prompt)
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    # the state group's hit (the state after token 8) sits at the head of the free queue
    assert kv.allocate_slots(b, 1, hits) is not None
    main, state = _ids(kv, "b")
    assert not set(main) & set(state)
    assert kv.pool.blocks[state[0]].ref_cnt == 1


def _scheduler(groups) -> Scheduler:
    sc = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256)
    return Scheduler(sc, CacheConfig(block_size=BS), 32, num_speculative_tokens=2,
                     kv_groups=groups)


def test_only_linear_states_replay_a_verified_run():
    """A verified step's accepted run is passed on for linear-attention layers to fold in;
    a model of sliding and full attention layers (several groups, no states) gets none."""
    from shoal.core.kv_cache_spec import SlidingWindowSpec
    from shoal.core.request import RequestStatus

    sliding = (KVCacheGroup(FULL, (0,)), KVCacheGroup(SlidingWindowSpec(2, 16, 4, 8), (1,)))
    for groups, want in ((GROUPS, 2), (sliding, 0)):
        sched = _scheduler(groups)
        req = _req("a", list(range(3, 12)))
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = 12
        sched._settle_verified(req, 2, 1)
        assert req.state_replay == want
