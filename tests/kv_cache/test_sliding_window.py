"""KV cache groups (shoal/core/kv_cache_spec.py): sliding-window layers give back the blocks
that fell out of their window, a hybrid model (sliding layers beside full ones) keeps one
table per group over one pool, and both still give transformers' tokens."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import random_prompts, tiny_llm
from oracle import hf_greedy, write_tiny_checkpoint
from transformers import AutoModelForCausalLM

from shoal import SamplingParams
from shoal.core.kv_cache_spec import (
    FullAttentionSpec,
    KVCacheGroup,
    LatentAttentionSpec,
    SlidingWindowSpec,
    group_layers,
)
from shoal.core.request import Request
from shoal.kv_cache.manager import KVCacheManager

BS, WINDOW = 4, 8


def _req(rid: str, n: int, seed: int = 0) -> Request:
    rng = random.Random(seed)
    return Request(rid, [rng.randrange(3, 500) for _ in range(n)], SamplingParams(max_tokens=64),
                   frozenset(), 64)


def _held(kv: KVCacheManager, rid: str) -> list[int]:
    """How many blocks the request holds in each group."""
    return [sum(b is not None for b in t.blocks.get(rid, ())) for t in kv.tables]


def test_specs_group_layers_by_what_they_keep():
    full, latent = FullAttentionSpec(2, 16, 4), LatentAttentionSpec(1, 48, 4)
    sliding = SlidingWindowSpec(2, 16, 4, WINDOW)
    groups = group_layers([sliding, full, sliding, full])
    assert [g.layers for g in groups] == [(1, 3), (0, 2)]  # full attention first
    assert groups[1].sliding_window == WINDOW and groups[0].sliding_window is None
    assert [g.layers for g in group_layers([latent, latent])] == [(0, 1)]
    assert sliding.page_bytes(BS) == full.page_bytes(BS) == 2 * BS * 2 * 16 * 4
    assert latent.page_bytes(BS) == BS * 48 * 4
    assert sliding.first_needed_token(20) == 13 and full.first_needed_token(20) == 0


def test_many_sliding_layers_form_groups_no_larger_than_the_full_group():
    """Gemma 3's 5:1 pattern (the shipped 27B: 52 sliding, 10 full layers): the groups share
    tensors, so a block costs the largest group's pages; the sliding layers in groups of at
    most 10 make it 10 pages, not 52, and a request of the window's length holds fewer."""
    from shoal.worker.kv_cache_tensors import bytes_per_block

    full, sliding = FullAttentionSpec(16, 128, 2), SlidingWindowSpec(16, 128, 2, 1024)
    specs = [full if i % 6 == 5 else sliding for i in range(62)]
    groups = group_layers(specs)
    assert groups[0].layers == tuple(range(5, 62, 6))
    assert [len(g.layers) for g in groups[1:]] == [8, 9, 9, 8, 9, 9]
    assert sorted(i for g in groups[1:] for i in g.layers) == [
        i for i in range(62) if i % 6 != 5]
    assert all(g.sliding_window == 1024 for g in groups[1:])
    assert bytes_per_block(specs, groups, 16) == 10 * full.page_bytes(16)
    # pages a request of 1,125 tokens holds: one block id per 16 tokens per table
    ids = 71 + 6 * 65
    assert ids * 10 < 0.7 * (71 + 65) * 52
    # equal kinds (GPT-OSS's 1:1), other row shapes and lone kinds are left as they were
    assert [len(g.layers) for g in group_layers([sliding, full] * 12)] == [12, 12]
    odd = [FullAttentionSpec(8, 128, 2)] + [sliding] * 5
    assert [len(g.layers) for g in group_layers(odd)] == [1, 5]
    assert [len(g.layers) for g in group_layers([sliding] * 7)] == [7]
    # pipeline stages group their own layers: the split would differ by stage, so it is off
    assert [len(g.layers) for g in group_layers(specs, split_windows=False)] == [10, 52]


def _decode(kv: KVCacheManager, req: Request, steps: int) -> None:
    for t in range(steps):
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        req.append_output_token(100 + t)


def test_a_sliding_table_gives_back_the_blocks_behind_its_window():
    group = KVCacheGroup(SlidingWindowSpec(1, 1, 1, WINDOW), (0,))
    kv = KVCacheManager(32, BS, groups=(group,))
    req = _req("a", 6)
    assert kv.allocate_slots(req, 6) is not None
    req.num_computed_tokens = 6
    _decode(kv, req, 40)  # 46 tokens: a full table would hold 12 blocks
    ids = kv.block_ids("a")
    assert len(ids) == 12
    first_kept = (req.num_computed_tokens - 1 - WINDOW + 1) // BS
    assert all(b == kv.null_block for b in ids[:first_kept - 1])  # behind the window
    assert _held(kv, "a")[0] <= WINDOW // BS + 2
    assert kv.num_free_blocks == 32 - _held(kv, "a")[0]
    kv.free(req)
    assert kv.num_free_blocks == 32 and all(b.ref_cnt == 0 for b in kv.pool.blocks)


def test_a_hybrid_model_keeps_one_table_per_group_over_one_pool():
    full = KVCacheGroup(FullAttentionSpec(1, 1, 1), (0,))
    sliding = KVCacheGroup(SlidingWindowSpec(1, 1, 1, WINDOW), (1,))
    kv = KVCacheManager(40, BS, groups=(full, sliding))
    a = _req("a", 10)
    assert kv.allocate_slots(a, 10) is not None
    a.num_computed_tokens = 10
    assert _held(kv, "a") == [3, 3]
    _decode(kv, a, 26)  # 36 tokens
    full_ids, (sliding_ids,) = kv.block_ids("a"), kv.group_block_ids("a")
    assert len(full_ids) == len(sliding_ids) == 9
    assert kv.null_block not in full_ids and sliding_ids.count(kv.null_block) >= 5
    assert not set(full_ids) & {b for b in sliding_ids if b != kv.null_block}
    # All or nothing: a request that fits one group's blocks but not both gets none.
    free = kv.num_free_blocks
    big = _req("b", free * BS - BS)
    assert kv.allocate_slots(big, big.num_tokens) is None and kv.num_free_blocks == free
    kv.free(a)
    assert kv.num_free_blocks == 40


def test_a_hybrid_prefix_hit_needs_the_full_prefix_and_the_window():
    full = KVCacheGroup(FullAttentionSpec(1, 1, 1), (0,))
    sliding = KVCacheGroup(SlidingWindowSpec(1, 1, 1, WINDOW), (1,))
    kv = KVCacheManager(64, BS, groups=(full, sliding))
    a = _req("a", 33, seed=3)
    assert kv.allocate_slots(a, 33) is not None
    a.num_computed_tokens = 33
    kv.free(a)  # everything cached: 8 full blocks of each group
    b = _req("b", 33, seed=3)
    hits, n = kv.get_computed_blocks(b)
    assert n == 32 and len(hits) == 8
    assert kv.allocate_slots(b, 1, hits) is not None
    b.num_computed_tokens = 33
    (sliding_ids,) = kv.group_block_ids("b")
    # The sliding group took only the blocks its window needs from the cache: a query at 32
    # reads keys (24, 32], blocks 6.. of 4 tokens.
    assert sliding_ids[:6] == [kv.null_block] * 6 and kv.null_block not in sliding_ids[6:]


@pytest.mark.parametrize("arch,extra", [
    ("mistral", {"sliding_window": WINDOW}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
], ids=["all-sliding", "hybrid"])
def test_sliding_window_models_match_transformers(tmp_path, arch, extra):
    """Mistral with every layer sliding, and Qwen2 whose second layer slides beside a full
    one (two KV cache groups): greedy tokens are transformers', the sliding tables hold only
    their window, and a repeated prompt hits the prefix cache."""
    path = write_tiny_checkpoint(tmp_path / arch, arch, seed=4, **extra)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = tiny_llm(path, max_num_batched_tokens=24, block_size=BS, num_gpu_blocks_override=256)
    sched = llm.llm_engine.core.scheduler
    assert len(sched.kv.tables) == (1 if arch == "mistral" else 2)
    prompts = random_prompts(4, seed=5, lo=10, hi=40)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p["prompt_token_ids"], 24)[0], arch
    eng = llm.llm_engine
    eng.add_request("x", prompts[0], params)
    while eng.has_unfinished_requests():
        eng.step()
        held = _held(sched.kv, "x")
        if held and held[-1]:
            assert held[-1] <= WINDOW // BS + 2  # the sliding group's table, once running
    again = llm.generate(prompts[1], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == outs[1].outputs[0].token_ids
