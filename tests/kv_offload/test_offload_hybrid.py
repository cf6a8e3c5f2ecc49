"""The CPU and disk tiers on a hybrid (Gated DeltaNet layers beside attention, tiny Qwen3.5):
attention blocks and the linear layers' block-end states leave the device together and
come back together, so a tier hit restores the state of its last block: the same tokens as
transformers, from the device, the CPU tier, the disk tier, or recomputed."""

from __future__ import annotations

import pytest
import torch
from greedy_runs import random_prompt
from oracle import hf_greedy, write_tiny_checkpoint
from transformers import AutoModelForCausalLM

from shoal import LLM, SamplingParams
from shoal.kv_cache.hashing import hash_full_blocks

LINEAR = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
BLOCK = 64  # raised from 16 so an attention page holds a linear layer's state
# one tensor (the largest group has one layer): K and V of 2 heads x 16, float32
BLOCK_BYTES = 2 * BLOCK * 2 * 16 * 4
STEPS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)


P = random_prompt(1, 200)  # 3 full blocks: a hit restores 192 tokens and the state after them
OTHERS = [random_prompt(100 + i, 200) for i in range(3)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("qwen35"), "qwen3_5_text", seed=4,
                                 **LINEAR)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf_greedy(hf, P, STEPS)[0]


def _llm(path, disk=None, **kw) -> LLM:
    args = dict(dtype="float32", max_model_len=512, num_gpu_blocks_override=24,
                max_num_batched_tokens=256, kv_offloading_size=64 * BLOCK_BYTES / 2**30)
    if disk is not None:
        args.update(kv_offloading_disk_path=str(disk),
                    kv_offloading_disk_size=256 * (BLOCK_BYTES + 64) / 2**30)
    args.update(kw)
    return LLM(model=str(path), **args)


def _run(llm: LLM, prompt: list[int] = P) -> tuple[int, list[int]]:
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    return out.num_cached_tokens, out.outputs[0].token_ids


def _store(llm: LLM):
    return llm.llm_engine.core.kv_offload


def _hits(llm: LLM) -> dict[str, int]:
    return {t.name: t.hits for t in _store(llm).stats().tiers}


def _push_out_of_device(llm: LLM) -> None:
    for o in OTHERS:
        _run(llm, o)
    kv = llm.llm_engine.core.scheduler.kv
    h = hash_full_blocks(P, BLOCK, [])
    assert all(t.cached(h[0]) is None for t in kv.tables)


def test_same_tokens_from_device_cpu_disk_and_recompute(tiny, tmp_path):
    path, ref = tiny
    llm = _llm(path, tmp_path / "disk")
    assert llm.llm_engine.config.cache_config.block_size == BLOCK
    assert _run(llm) == (0, ref)  # computed
    assert _run(llm) == (192, ref)  # device blocks, device state
    _push_out_of_device(llm)
    before = _hits(llm)
    assert _run(llm) == (192, ref)  # attention blocks and the state from the CPU tier
    # 3 blocks of the attention group, and the third block's state of each of the three
    # linear layers' groups
    assert _hits(llm)["cpu"] - before["cpu"] == 3 + 3
    _push_out_of_device(llm)
    _store(llm).flush()  # down to the disk tier
    before = _hits(llm)
    assert _run(llm) == (192, ref)
    assert _hits(llm)["disk"] - before["disk"] == 6
    _push_out_of_device(llm)
    _store(llm).clear()
    assert _run(llm) == (0, ref)  # recomputed
    sched = llm.llm_engine.core.scheduler
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
    assert _store(llm).cpu.num_pinned() == 0 and not sched.offload.num_plans_in_flight
    _store(llm).check()


def test_a_missing_state_shortens_the_hit_to_a_block_that_has_one(tiny):
    """Attention blocks without the state at their end are no hit there: the hit ends at the
    last block whose states the tiers hold (here none: only the attention group's blocks are
    kept), and nothing is loaded for it."""
    path, ref = tiny
    llm = _llm(path)
    _run(llm)
    _push_out_of_device(llm)
    store = _store(llm)
    kv = llm.llm_engine.core.scheduler.kv
    hashes = hash_full_blocks(P, BLOCK, [])
    for t in kv.tables:
        if t.publishes_computed:
            store.discard([t.key(h) for h in hashes])
    assert _run(llm) == (0, ref)
    assert store.cpu.num_pinned() == 0


def test_state_tables_start_at_the_loaded_state(tiny):
    """After a tier hit of n blocks the linear-state tables start at block n - 1, where the
    state is loaded; the entries before it stay empty (no block allocated, none published)."""
    path, ref = tiny
    llm = _llm(path)
    _run(llm)
    _push_out_of_device(llm)
    kv = llm.llm_engine.core.scheduler.kv
    seen: list[list[list]] = []
    allocate = kv.allocate_slots

    def recording(request, num_new_tokens, new_computed=None, loaded_blocks=0, **kw):
        out = allocate(request, num_new_tokens, new_computed, loaded_blocks, **kw)
        if loaded_blocks:
            seen.append([list(t.blocks[request.request_id]) for t in kv.tables
                         if t.publishes_computed])
        return out

    kv.allocate_slots = recording
    assert _run(llm) == (192, ref)
    assert len(seen) == 1 and len(seen[0]) == 3  # one table per linear layer's group
    for table in seen[0]:
        assert table[:2] == [None, None] and table[2] is not None
    assert _run(llm) == (192, ref)  # the loaded states serve a device hit next
