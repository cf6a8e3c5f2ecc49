"""Prefill/decode disaggregation for models of several KV cache groups: sliding-window layers
beside full attention (a tiny Gemma 2, fp32, prompts past its window). The decode engine's
greedy tokens and logprobs are one engine's, also with another block size on each side; the
sliding layers send only the rows their window reads at the prompt's end, and the decode
engine's sliding tables take no block before them. A later prompt sharing the loaded one's
prefix still gives one engine's answer (the block the loaded window starts inside is kept out
of the prefix cache). Rows and tables of windows of two lengths in pieces (hybrids of
linear-attention layers: test_p2p_hybrid.py)."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import tiny_llm
from oracle import write_tiny_checkpoint

from shoal import SamplingParams
from shoal.core.kv_cache_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from shoal.core.request import Request
from shoal.kv_cache.manager import KVCacheManager
from shoal.kv_transfer.base import KVRows
from shoal.kv_transfer.rows import LayerTables, gather_rows, scatter_rows

WINDOW = 8
STEPS = 6
_rng = random.Random(3)
LOADED = [_rng.randrange(3, 500) for _ in range(47)]  # p0 = 46: its window starts at 39
SHARED = LOADED[:45] + [_rng.randrange(3, 500) for _ in range(6)]  # hits 11 blocks of 4
PROMPTS = [LOADED, [_rng.randrange(3, 500) for _ in range(30)]]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0, **kw)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    """A tiny Gemma 2 (layers sliding, full, sliding, full) and one engine's answers."""
    path = write_tiny_checkpoint(
        tmp_path_factory.mktemp("gemma2"), "gemma2", seed=5, num_hidden_layers=4, head_dim=16,
        query_pre_attn_scalar=16, sliding_window=WINDOW, attn_logit_softcapping=None,
        final_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh")
    llm = tiny_llm(path)
    assert len(llm.llm_engine.core.scheduler.kv.tables) == 2
    outs = llm.generate([{"prompt_token_ids": p} for p in [*PROMPTS, SHARED]], _greedy(),
                        use_tqdm=False)
    llm.shutdown()
    return path, [_answer(o) for o in outs]


def _answer(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]


def _same(got, want) -> None:
    assert got[0] == want[0]
    assert max(abs(a - b) for a, b in zip(got[1], want[1])) < 1e-4


@pytest.mark.parametrize("sizes", [(4, 4), (8, 4)], ids=["same", "8-4"])
def test_sliding_and_full_groups_are_transferred(gemma2, sizes) -> None:
    path, want = gemma2
    producer = tiny_llm(path, block_size=sizes[0], kv_transfer_config={
        "kv_connector": "P2PConnector", "kv_role": "kv_producer", "kv_port": 0})
    consumer = tiny_llm(path, block_size=sizes[1], kv_transfer_config={
        "kv_connector": "P2PConnector", "kv_role": "kv_consumer"})
    try:
        kept = producer.llm_engine.core.kv_connector._store
        params = []
        for p in PROMPTS:
            (out,) = producer.generate({"prompt_token_ids": p}, SamplingParams(
                temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                use_tqdm=False)
            params.append(out.kv_transfer_params)
        layout = next(iter(kept.values())).payload.layout
        # layers 0 and 2 slide: only the window at the prompt's last token is sent
        assert layout.starts == [len(LOADED) - WINDOW, 0, len(LOADED) - WINDOW, 0]
        sched = consumer.llm_engine.core.scheduler
        seen: dict[int, list[bool]] = {}  # prompt length -> its sliding entries held
        admit = sched.admission.connector.admitted

        def admitted(req, start, n, block_ids, group_block_ids=()) -> None:
            seen[req.num_prompt_tokens] = [i != sched.kv.null_block for i in group_block_ids[0]]
            admit(req, start, n, block_ids, group_block_ids)

        sched.admission.connector.admitted = admitted
        outs = consumer.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                 [_greedy(kv_transfer_params=kp) for kp in params],
                                 use_tqdm=False)
        connector = consumer.llm_engine.core.kv_connector
        assert connector.num_loaded == len(PROMPTS) and connector.num_failed == 0
        for out, w in zip(outs, want):
            _same(_answer(out), w)
            assert out.num_cached_tokens == len(out.prompt_token_ids) - 1  # loaded, not run
        bs = sizes[1]
        # the sliding table held no block before its window at the first computed token
        held = seen[len(LOADED)]
        first = (len(LOADED) - WINDOW) // bs
        assert not any(held[:first]) and all(held[first:])
        # a prompt sharing the loaded one's first 45 tokens: its prefix hits stop where the
        # loaded window's rows do (same answer as one engine)
        again = consumer.generate({"prompt_token_ids": SHARED}, _greedy(), use_tqdm=False)[0]
        _same(_answer(again), want[-1])
    finally:
        producer.shutdown()
        consumer.shutdown()


def _req(n: int) -> Request:
    rng = random.Random(n)
    return Request("r", [rng.randrange(3, 500) for _ in range(n)],
                   SamplingParams(max_tokens=4), frozenset(), 64)


def test_rows_of_two_window_lengths_across_block_sizes() -> None:
    """Three groups (full, windows of 8 and 12), one layer each: blocks of 4 on the producer,
    whose sliding tables dropped their early blocks (they read a garbage block), blocks of 8
    on the consumer, whose KV manager allocates only the windows' blocks."""
    n, gen = 45, torch.Generator().manual_seed(0)
    groups = (KVCacheGroup(FullAttentionSpec(2, 4, 4), (0,)),
              KVCacheGroup(SlidingWindowSpec(2, 4, 4, 8), (1,)),
              KVCacheGroup(SlidingWindowSpec(2, 4, 4, 12), (2,)))
    tables = LayerTables.of(groups)
    assert tables.groups == (0, 1, 2) and tables.windows == (None, 8, 12)
    src = [torch.randn(2, 4 * 64, 2, 4, generator=gen) for _ in range(3)]
    ids = torch.randperm(60, generator=gen).tolist()
    src_tables = [ids[:12], [63] * 9 + ids[12:15], [63] * 8 + ids[15:19]]  # 63: dropped
    payload = gather_rows(src, src_tables[0], 4, n, tables, src_tables[1:])
    assert payload.layout.starts == [0, 37, 33]
    assert payload.nbytes == (45 + 8 + 12) * 2 * 2 * 4 * 4

    kv = KVCacheManager(64, 8, groups=groups)
    req = _req(n)
    assert kv.allocate_slots(req, n, loaded_tokens=n - 1) is not None  # admission's call
    dst_ids = [kv.block_ids("r"), *kv.group_block_ids("r")]
    # a query at 44 reads keys from 37 (window 8) and 33 (window 12): blocks 4.. of 8
    for t in dst_ids[1:]:
        assert t[:4] == [kv.null_block] * 4 and kv.null_block not in t[4:]
    # block 4 of each sliding table starts before its window's rows: not in the prefix cache
    assert [t.blocks["r"][4].block_hash is None for t in kv.tables] == [False, True, True]
    dst = [torch.zeros(2, 8 * 65, 2, 4) for _ in range(3)]
    scatter_rows(dst, payload.layout, payload.data, dst_ids[0], 8, 0, n - 1, tables,
                 dst_ids[1:])
    for i, first in enumerate([0, 37, 33]):
        pos = torch.arange(first, n - 1)
        got = dst[i][:, torch.tensor(dst_ids[i])[pos // 8] * 8 + pos % 8]
        want = src[i][:, torch.tensor(src_tables[i])[pos // 4] * 4 + pos % 4]
        assert torch.equal(got, want)
    assert not dst[1][:, 64 * 8:].any()  # nothing went to the null block
    # a consumer whose layer keeps a longer window than the producer sent is refused
    wider = LayerTables((0, 1, 2), (None, 16, 12))
    with pytest.raises(ValueError, match="layer 1's transferred rows start at token 37"):
        scatter_rows(dst, payload.layout, payload.data, dst_ids[0], 8, 0, n - 1, wider,
                     dst_ids[1:])
    rows = [(2, 2, 16)] * 3
    KVRows("float32", rows, (None, 8, 12)).check(payload.layout, 1)
    with pytest.raises(ValueError, match="layer 2 starts at token 33, this layer reads from "
                                         "token 29"):
        KVRows("float32", rows, (None, 8, 16)).check(payload.layout, 1)
