"""The CPU and disk tiers on DeepSeek-V4 (the tiny config of tests/models/test_deepseek_v4.py,
a random checkpoint: a sliding, two CSA (m = 4) and an HCA (m' = 16) layer, a window of 8,
blocks of 4 tokens). Its four KV cache groups each have a partition of the pool, pages of
their own size (the CSA entries, the HCA entries in one block of four, the window rows with
CSA's open groups, HCA's open group), and the CPU tier a pool of slots per group
(grouped_cpu_tier.py). A prefix evicted from a small device pool and brought back from the
CPU tier, from the disk tier, or with the entries still on the device and only the window
groups' blocks in the tiers, gives the tokens of a miss, loading of the window groups only
the blocks their windows read."""

from __future__ import annotations

import pytest
import torch
from greedy_runs import greedy_run, random_prompt
from models.test_deepseek_v4 import V4
from transformers import AutoConfig, AutoModelForCausalLM

from shoal import LLM, SamplingParams
from shoal.core.kv_cache_spec import FullAttentionSpec, KVCacheGroup
from shoal.core.kv_transfer_plan import KVTransferPlan
from shoal.kv_cache.hashing import hash_full_blocks
from shoal.kv_offload.control import persist
from shoal.kv_offload.grouped_cpu_tier import GroupedCPUTier
from shoal.kv_offload.grouped_transfer import GroupedKVTransfer, page_groups
from shoal.kv_offload.layout import BlockLayout

BLOCK = 4
# 12 tokens: the decode closes the HCA group of positions 64..79 (its first rows loaded)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


P = random_prompt(1, 70)  # 17 full blocks: a hit restores 68 tokens
# What a hit of 17 blocks loads of each group: every CSA entries block; the HCA entries of
# blocks 3, 7, 11, 15 (each closing a group of 16); the window's (8) blocks 15 and 16; HCA's
# open group (16 tokens back from token 68): blocks 13..16
HIT_BLOCKS = [17, 4, 2, 4]


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    """One engine for the module (its first step pays a warm-up) on a random checkpoint
    whose weights are large enough that every cache moves the logprobs (shoal's dummy
    weights are not); 48 blocks of CSA entries (the first group's partition; the window
    groups' follow max_num_seqs and max_num_batched_tokens: 16 and 20 blocks)."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v4", **V4),
                                          dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        for name, b in hf.named_buffers():
            if name.endswith("tid2eid"):  # k distinct experts per token
                b.copy_(torch.stack([torch.randperm(V4["n_routed_experts"])[:2]
                                     for _ in range(b.shape[0])]))
    path = tmp_path_factory.mktemp("dsv4-offload")
    hf.save_pretrained(path, safe_serialization=True)
    return LLM(model=str(path), dtype="float32", block_size=BLOCK, max_model_len=256,
               max_num_seqs=2, num_gpu_blocks_override=48, max_num_batched_tokens=32,
               kv_offloading_size=2 / 1024, kv_offloading_disk_path=str(path / "disk"),
               kv_offloading_disk_size=10 / 1024)


def _generate(llm: LLM, prompt: list[int]) -> tuple[int, list[int], list[float]]:
    return greedy_run(llm, prompt, GREEDY)


def _same(got: tuple, want: tuple) -> None:
    """Cached tokens and tokens exactly, logprobs to 1e-5 (atomics in a GPU's MoE sums)."""
    assert got[:2] == want[:2]
    torch.testing.assert_close(got[2], want[2], atol=1e-5, rtol=0)


def _on_device(llm: LLM, prompt: list[int]) -> list[int]:
    """The prompt's blocks each group caches on the device."""
    kv = llm.llm_engine.core.scheduler.kv
    hashes = hash_full_blocks(prompt, BLOCK, [])
    return [sum(t.cached(h) is not None for h in hashes) for t in kv.tables]


def _hits(llm: LLM) -> dict[str, int]:
    return {t.name: t.hits for t in llm.llm_engine.core.kv_offload.stats().tiers}


def _push_out(llm: LLM, prompt: list[int], seed: int) -> None:
    """Prompts never seen before (a tier hit of theirs would allocate fewer blocks), enough
    to cycle every partition's free blocks."""
    for i in range(4):
        _generate(llm, random_prompt(100 + 10 * seed + i, 80))
    assert _on_device(llm, prompt) == [0, 0, 0, 0]


def _record_loads(llm: LLM, monkeypatch) -> list[int]:
    """Counts the blocks tier loads put in each group, checking each lands in a block of
    its group's partition."""
    sched = llm.llm_engine.core.scheduler
    runs = [(t.page_base + 1, t.group.num_blocks) for t in sched.kv.tables]
    counts = [0] * len(runs)
    commit = sched.offload.commit

    def recording(staged, block_at):
        for b in staged:
            counts[b.group] += 1
            first, n = runs[b.group]
            assert first <= block_at(b.group, b.index).block_id < first + n
        return commit(staged, block_at)
    monkeypatch.setattr(sched.offload, "commit", recording)
    return counts


def test_same_tokens_from_device_cpu_disk_and_recompute(llm, monkeypatch):
    store = llm.llm_engine.core.kv_offload
    assert isinstance(store.cpu, GroupedCPUTier)
    # a slot per group of that group's block size (CSA entries: 2 layers x 4 slots x 16
    # values; HCA: 1 x 4 x 8; window + CSA open groups: 4 x 4 x 32 + 2 x 4 x 256; HCA's
    # open group: 4 x 64; float32)
    assert store.cpu.layout.group_bytes == (512, 128, 10240, 1024)
    miss = _generate(llm, P)
    assert miss[0] == 0
    device = _generate(llm, P)
    assert device[:2] == (68, miss[1])
    loaded = _record_loads(llm, monkeypatch)
    _push_out(llm, P, 0)
    before = _hits(llm)
    _same(_generate(llm, P), device)  # the same computation as after the device hit
    assert loaded == HIT_BLOCKS
    assert _hits(llm)["cpu"] - before["cpu"] == sum(HIT_BLOCKS)
    persist(llm.llm_engine.core)  # every partition's cached blocks down to the disk tier
    assert _on_device(llm, P) == [0, 0, 0, 0]
    before = _hits(llm)
    _same(_generate(llm, P), device)
    assert _hits(llm)["disk"] - before["disk"] == sum(HIT_BLOCKS)
    assert llm.llm_engine.core.scheduler.kv.reset_prefix_cache()
    store.clear()
    _same(_generate(llm, P), miss)
    sched = llm.llm_engine.core.scheduler
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
    assert store.cpu.num_pinned() == 0 and not sched.offload.num_plans_in_flight
    store.check()


def test_entries_on_the_device_and_windows_in_the_tier(llm):
    """Another prompt pushes Q's window blocks out (their partitions are small) but leaves
    its entries on the device: the device hit stops at 0, and the tier hit copies the free
    cached entries through the CPU tier in the same plan (stores before loads). Then a block
    of the window missing from the tiers shortens the hit to where the window's blocks are
    held."""
    q = random_prompt(2, 70)
    miss = _generate(llm, q)
    device = _generate(llm, q)
    _generate(llm, random_prompt(99, 90))
    assert _on_device(llm, q) == [17, 4, 0, 0]
    conn = llm.llm_engine.core.scheduler.offload
    stored = conn.num_stored_blocks
    _same(_generate(llm, q), device)
    # the device's entries of both CSA and HCA (17 + 4) went through the CPU tier
    assert conn.num_stored_blocks - stored >= 21
    _push_out(llm, q, 1)
    store = llm.llm_engine.core.kv_offload
    window = llm.llm_engine.core.scheduler.kv.tables[2]
    store.discard([window.key(hash_full_blocks(q, BLOCK, [])[16])])
    cached, tokens, _ = _generate(llm, q)
    assert cached == 64 and tokens == miss[1]
    store.check()


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs CUDA"))])
def test_partitioned_copies_move_each_groups_pages(device):
    """GroupedKVTransfer alone, over a partitioned pool: a group of two tensors of different rows (3 blocks) and
    a group of one two-plane tensor (2 blocks); blocks stored into their groups' slots and
    loaded into other blocks arrive byte for byte, and a block never goes to another group's
    slot. On CUDA: the side stream, staging buffers and pinned pools."""
    bs = 4
    spec = FullAttentionSpec(1, 8, 4)
    groups = (KVCacheGroup(spec, (0, 1), num_blocks=3), KVCacheGroup(spec, (2,), num_blocks=2))
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(shape, generator=gen).to(device)  # [planes, (n + 1) bs, Hk, D]
              for shape in ((1, 16, 1, 16), (1, 16, 1, 8), (2, 12, 2, 8))]
    layout = BlockLayout.grouped((4 * (16 + 8) * 4, 2 * 4 * 2 * 8 * 4), bs, torch.float32)
    tier = GroupedCPUTier(layout, 8 * 768, "lru", shares=[1, 1],
                          pin_memory=device == "cuda")
    transfer = GroupedKVTransfer(page_groups(caches, groups, bs), tier, bs)
    key = [bytes([i]) * 16 for i in range(3)]
    # ids: group 0's blocks 1..3, group 1's 4..5 (each group's page = id - first + 1)
    slots = [tier.reserve(key[0]), tier.reserve(key[1]), tier.reserve(key[2] + b"\x01")]
    assert tier.group_of_slot(slots[2]) == 1
    before = [kv.clone() for kv in caches]

    def page(kv: torch.Tensor, p: int) -> torch.Tensor:
        return kv[:, p * bs:(p + 1) * bs]

    transfer.run(KVTransferPlan(stores=[(1, slots[0]), (3, slots[1]), (5, slots[2])],
                                plan_id=0))
    transfer.wait(0)
    for kv in caches:
        kv.zero_()
    transfer.run(KVTransferPlan(loads=[(slots[0], 2), (slots[1], 1), (slots[2], 4)],
                                plan_id=1))
    transfer.wait(1)
    for kv, old in zip(caches[:2], before[:2]):  # block 1 -> page 2, block 3 -> page 1
        torch.testing.assert_close(page(kv, 2), page(old, 1), rtol=0, atol=0)
        torch.testing.assert_close(page(kv, 1), page(old, 3), rtol=0, atol=0)
    torch.testing.assert_close(page(caches[2], 1), page(before[2], 2), rtol=0, atol=0)
    assert not page(caches[2], 2).any() and not page(caches[0], 3).any()
    with pytest.raises(ValueError, match="not of one KV cache group"):
        transfer.run(KVTransferPlan(stores=[(4, slots[0])], plan_id=2))
    tier.check()
