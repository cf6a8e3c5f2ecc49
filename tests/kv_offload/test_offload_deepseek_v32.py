"""The CPU tier on DeepSeek-V3.2 (tiny random checkpoint, fp32, blocks of 4): each layer
keeps a latent row and its indexer's key row per token, tensors of two widths on one block
table, so a CPU slot holds a block's pages of both as bytes (BlockLayout.grouped with one
copy group). A prefix pushed off the device comes back from the tier with the device hit's
tokens and logprobs (a prompt past index_topk, so the indexer's keys are read)."""

from __future__ import annotations

import torch
from deepseek_tiny import write_deepseek
from greedy_runs import greedy_run, random_prompt
from models.test_deepseek_v32 import V32

from shoal import LLM
from shoal.kv_cache.hashing import hash_full_blocks
from shoal.kv_offload.grouped_cpu_tier import GroupedCPUTier


def test_latents_and_indexer_keys_come_back_together(tmp_path):
    path, _ = write_deepseek(tmp_path, "deepseek_v32", seed=3, **V32)
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_model_len=256,
              num_gpu_blocks_override=40, max_num_batched_tokens=32,
              kv_offloading_size=1 / 1024)
    store = llm.llm_engine.core.kv_offload
    assert isinstance(store.cpu, GroupedCPUTier) and len(store.cpu.layout.group_bytes) == 1
    p = random_prompt(1, 70)  # 17 full blocks; index_topk is 8
    miss = greedy_run(llm, p)
    device = greedy_run(llm, p)
    assert (miss[0], device[0], device[1]) == (0, 68, miss[1])
    for i in range(4):
        greedy_run(llm, random_prompt(100 + i, 80))
    assert llm.llm_engine.core.scheduler.kv.tables[0].cached(hash_full_blocks(p, 4, [])[0]) \
        is None
    before = store.stats().tiers[0].hits
    hit = greedy_run(llm, p)
    assert hit[:2] == device[:2]
    torch.testing.assert_close(hit[2], device[2], atol=1e-5, rtol=0)
    assert store.stats().tiers[0].hits - before == 17
    store.check()
