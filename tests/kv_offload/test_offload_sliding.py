"""The CPU tier on a sliding-window hybrid whose groups share the pool's tensors (a tiny
Gemma 2: sliding, full, sliding, full; a window of 8, blocks of 4): a prefix pushed off the
device comes back from the tier with every full-attention block and, of the sliding group,
only the two blocks its window reads, and gives the device hit's tokens and logprobs."""

from __future__ import annotations

from greedy_runs import greedy_run, random_prompt
from oracle import write_tiny_checkpoint

from shoal import LLM
from shoal.kv_cache.hashing import hash_full_blocks


def test_window_blocks_come_back_with_the_full_ones(tmp_path):
    write_tiny_checkpoint(tmp_path, "gemma2", seed=5, num_hidden_layers=4, head_dim=16,
                          query_pre_attn_scalar=16, sliding_window=8,
                          attn_logit_softcapping=None, final_logit_softcapping=None,
                          hidden_activation="gelu_pytorch_tanh")
    llm = LLM(model=str(tmp_path), dtype="float32", block_size=4,
              max_model_len=256, max_num_seqs=2, num_gpu_blocks_override=40,
              max_num_batched_tokens=32, kv_offloading_size=2 / 1024)
    p = random_prompt(1, 70, hi=500)  # 17 full blocks: a hit of 68 tokens
    miss = greedy_run(llm, p)
    device = greedy_run(llm, p)
    assert (miss[0], device[0], device[1]) == (0, 68, miss[1])
    for i in range(4):
        greedy_run(llm, random_prompt(100 + i, 80, hi=500))
    kv = llm.llm_engine.core.scheduler.kv
    hashes = hash_full_blocks(p, 4, [])
    assert [sum(t.cached(h) is not None for h in hashes) for t in kv.tables] == [0, 0]
    store = llm.llm_engine.core.kv_offload
    before = store.stats().tiers[0].hits
    hit = greedy_run(llm, p)
    assert hit[:2] == device[:2]
    assert max(abs(a - b) for a, b in zip(hit[2], device[2])) < 1e-5
    assert store.stats().tiers[0].hits - before == 17 + 2  # the window's: blocks 15 and 16
    store.check()
