"""A pool partition per KV cache group (DeepSeek-V4's windows, entries and open groups): the
capacity the compressed entries save reaches the pool, each group allocates from its own run
of block ids, tables hold the group's pages (null page 0), and fault zeroing by block id
touches only that block's group."""

from __future__ import annotations

import pytest
import torch

from shoal.core.kv_cache_spec import (
    CompressedEntrySpec,
    CompressorStateSpec,
    SlidingSharedKVSpec,
    context_bytes_per_token,
    group_layers,
    pool_partitions,
)
from shoal.core.request import Request
from shoal.kv_cache.manager import KVCacheManager
from shoal.sampling_params import SamplingParams
from shoal.worker.kv_cache_tensors import (
    allocate_partitioned,
    bytes_per_block,
    layer_specs,
    partitions_pool,
)
from shoal.worker.kv_pool_split import (
    SplitLimits,
    group_page_bytes,
    partitioned_bytes,
    split_pool,
)


def _request(rid: str, ids: list[int]) -> Request:
    return Request(rid, ids, SamplingParams(max_tokens=8), frozenset(), 8)


def _longest_request(kv: KVCacheManager, chunk: int) -> int:
    """Tokens one request reaches, `chunk` a step, before the pool refuses a step."""
    req = _request("long", [5])
    while kv.allocate_slots(req, chunk) is not None:
        req.num_computed_tokens += chunk
    return req.num_computed_tokens


def _shipped_specs() -> list:
    from shoal.layers.compressed_attention import CompressedAttention
    from shoal.loader import load_model

    cfg = load_model("deepseek-ai/DeepSeek-V4-Flash-Base-4layers", load_format="dummy").hf_config
    with torch.device("meta"):
        layers = [p for i in range(cfg.num_hidden_layers)
                  for p in CompressedAttention(cfg, i, torch.bfloat16, False).paged_layers()]
    return layer_specs(layers, torch.bfloat16)


def test_shipped_v4_tokens_in_a_budget_grow_by_the_specs_ratio():
    """DeepSeek-V4-Flash's 4-layer shape, bf16, blocks of 16, 256 MiB: one request grows until
    the pool refuses. In one shared pool a block of any group costs every layer's page; with
    a partition per group a token of context costs context_bytes_per_token (CSA entries 1 in
    4 tokens, HCA 1 in 128), the windows' and open groups' partitions a bounded reserve."""
    bs, budget = 16, 256 << 20
    limits = SplitLimits(max_num_seqs=8, max_num_batched_tokens=2048)
    specs = _shipped_specs()
    groups = group_layers(specs)
    assert partitions_pool(specs, groups, bs)
    shared_block = bytes_per_block(specs, groups, bs)  # 186,368 bytes
    whole = [g for g in groups if not g.spec.drops_blocks]
    # what a token of context costs: every layer's page per block each whole-context group
    # holds (CSA's every block, HCA's 1 in 8), against only those groups' own pages
    before = shared_block * sum(g.spec.held_fraction(bs) for g in whole) / bs
    after = context_bytes_per_token(specs, bs)
    assert (before, after) == (13104, 328)
    expected = before / after  # 39.95x

    old = KVCacheManager(budget // shared_block, bs, enable_caching=False, groups=groups)
    sized = split_pool(specs, groups, bs, limits, budget=budget)
    assert partitioned_bytes(specs, sized, bs) <= budget
    new = KVCacheManager(0, bs, enable_caching=False, groups=sized)
    tokens_before, tokens_after = _longest_request(old, 16), _longest_request(new, 2048)
    # the windows' reserve: 8 requests' windows and one step's 2048 tokens
    reserve = sum(group_page_bytes(specs, g, bs) * g.num_blocks for g in sized
                  if g.spec.drops_blocks)
    assert reserve < budget // 4
    # (less the window's blocks of the one request, 1% of the budget)
    assert tokens_before == pytest.approx(budget / before, rel=0.02)  # 20,485
    assert tokens_after == pytest.approx((budget - reserve) / after, rel=0.01)
    measured = tokens_after / tokens_before  # 20,336 -> 716,800 tokens: 35.2x
    assert measured == pytest.approx(expected * (1 - reserve / budget), rel=0.02)
    print(f"tokens in {budget >> 20} MiB: {tokens_before} -> {tokens_after} ({measured:.1f}x; "
          f"specs: {expected:.1f}x, {expected * (1 - reserve / budget):.1f}x beside the windows' "
          f"{reserve / budget:.0%})")
    assert measured > 0.85 * expected


TINY = [SlidingSharedKVSpec(1, 8, 4, 8), CompressedEntrySpec(1, 12, 4, ratio=4),
        CompressorStateSpec(1, 24, 4, 8), CompressedEntrySpec(1, 8, 4, ratio=16)]


def test_groups_allocate_from_their_own_runs_and_tables_hold_pages():
    groups = split_pool(TINY, group_layers(TINY), 4, SplitLimits(2, 40), first_blocks=12)
    # entries of 4 (the anchor), entries of 16 (a block in 4 + a partial one a request), window
    assert [(g.spec.table_kind, g.num_blocks) for g in groups] == [
        (("entries", 4), 12), (("entries", 16), 6), (("sliding", 8), 2 * 4 + 10)]
    runs = pool_partitions(groups)
    assert runs == ((1, 12), (13, 6), (19, 18))
    kv = KVCacheManager(0, 4, groups=groups)
    assert kv.null_block == 0
    a = _request("a", list(range(3, 43)))
    assert kv.allocate_slots(a, 40) is not None
    a.num_computed_tokens = 40
    for t, (first, n) in zip(kv.tables, runs):
        held = [b for b in t.blocks["a"] if b is not None]
        assert all(first <= b.block_id < first + n for b in held)
        assert t.ids["a"] == [t.page(b) for b in t.blocks["a"]]
        assert all(1 <= t.page(b) <= n for b in held)
    assert kv.block_ids("a") == list(range(1, 11))
    # the window keeps 2 blocks before token 40; HCA holds the blocks closing tokens 15, 31
    assert kv.group_block_ids("a")[0] == [0, 0, 0, 1, 0, 0, 0, 2, 0, 0]
    # 2 blocks of entries left, so a 12-token step is refused though the others have room
    b = _request("b", list(range(100, 112)))
    free = [kv.pool.num_free(p) for p in range(3)]
    assert free[0] == 2 and kv.allocate_slots(b, 12) is None
    assert [kv.pool.num_free(p) for p in range(3)] == free
    assert kv.allocate_slots(b, 8) is not None
    # a prefix hit shares every group's blocks
    kv.free(b)
    c = _request("c", list(range(3, 43)) + [1, 2])
    hits, n = kv.get_computed_blocks(c)
    assert n == 40 and kv.allocate_slots(c, 2, hits) is not None
    assert kv.tables[1].blocks["c"][:8] == kv.tables[1].blocks["a"][:8]


def test_fault_zeroing_by_block_id_touches_only_its_group():
    class Layer:
        kv_cache = None
        kv_group = -1

    groups = split_pool(TINY, group_layers(TINY), 4, SplitLimits(1, 4), first_blocks=3)
    layers = [Layer() for _ in TINY]
    pages = allocate_partitioned(layers, TINY, groups, torch.float32, torch.device("cpu"), 4)
    assert [layer.kv_group for layer in layers] == [2, 0, 2, 1]
    # each group's tensors: page 0 (null) and its own blocks' pages
    assert [layer.kv_cache.shape[1] // 4 for layer in layers] == [
        groups[layer.kv_group].num_blocks + 1 for layer in layers]
    for kv in pages.tensors:
        kv.fill_(1.0)
    first_of_hca = pages.runs[1][0]
    pages.zero([(first_of_hca, 2), (0, 0)], 4)  # HCA's first block from slot 2; the null
    for layer in layers:
        by_page = layer.kv_cache[0].view(-1, 4, *layer.kv_cache.shape[2:])
        assert by_page[0].abs().sum() == 0  # the null page of every group
        if layer.kv_group == 1:
            assert by_page[1, :2].min() == 1 and by_page[1, 2:].abs().sum() == 0
            assert by_page[2:].min() == 1
        else:  # the same id in no other group's pages
            assert by_page[1:].min() == 1
    with pytest.raises(ValueError, match="no KV cache group"):
        pages.zero([(sum(n for _, n in pages.runs) + 1, 0)], 4)


def test_groups_of_one_row_keep_the_shared_pool():
    """Full attention beside a sliding window of the same row (Gemma, Qwen2), one group
    (Llama): no partitions."""
    from shoal.core.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec

    hybrid = [FullAttentionSpec(2, 8, 2), SlidingWindowSpec(2, 8, 2, window=16)]
    assert not partitions_pool(hybrid, group_layers(hybrid), 16)
    assert not partitions_pool(hybrid[:1], group_layers(hybrid[:1]), 16)
    assert pool_partitions(group_layers(hybrid)) == ()
    kv = KVCacheManager(8, 4, groups=group_layers(hybrid))
    assert kv.null_block == 8 and kv.pool.sizes == (8,)
