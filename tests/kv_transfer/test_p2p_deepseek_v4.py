"""Prefill/decode disaggregation of DeepSeek-V4 (a tiny random checkpoint, fp32): a sliding
layer, two CSA layers (m = 4, groups overlapping by one: their open-group rows span 2m) and an
HCA layer (m' = 16, longer than a block: sparse entry tables), a window of 8. The decode
engine's greedy tokens and logprobs are one engine's, also with another block size on each
side and after a prefix hit of its own, for prompts ending inside a CSA and an HCA group
(30 tokens), on a closing CSA and HCA token (32: the consumer's first computed token closes
both from loaded open-group rows) and shorter than the window (7); the prompt is loaded, not
computed. Each kind of cache a decode reads (window rows, CSA and HCA entries with CSA's
indexer keys, both compressors' open-group rows) is needed: zeroed in the payload, the
answer changes. Entries re-sliced across block sizes land where the model's own reader finds
them (layers/paged_entries.py)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from engine_helpers import tiny_llm
from models.test_deepseek_v4 import V4  # the tiny V4 config

from shoal import SamplingParams
from shoal.core.kv_cache_spec import (
    CompressedEntrySpec,
    CompressorStateSpec,
    KVCacheGroup,
    SlidingSharedKVSpec,
)
from shoal.core.kv_connector_plan import KVLayout
from shoal.kv_transfer.base import KVRows
from shoal.kv_transfer.rows import LayerTables, gather_rows, scatter_rows
from shoal.layers.paged_entries import PagedEntries

STEPS = 6
_rng = random.Random(4)
PROMPTS = [[_rng.randrange(3, 512) for _ in range(n)] for n in (30, 32, 7)]
LOCAL = [_rng.randrange(3, 512) for _ in range(28)]  # run on the consumer first
HIT = LOCAL[:24] + [_rng.randrange(3, 512) for _ in range(8)]  # its 6 blocks of 4, loaded
# attention_layers(): per decoder layer its window rows, then (CSA / HCA) its entries and its
# compressor's open-group rows
WINDOW_ROWS, CSA_ENTRIES, HCA_ENTRIES = [0, 1, 4, 7], [2, 8], [5]
CSA_OPEN, HCA_OPEN = [3, 9], [6]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=0, **kw)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """The checkpoint and one engine's answers to PROMPTS, then HIT."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("deepseek_v4", **V4)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    path = tmp_path_factory.mktemp("dsv4-p2p")
    hf.save_pretrained(path, safe_serialization=True)
    llm = tiny_llm(path)
    outs = llm.generate([{"prompt_token_ids": p} for p in [*PROMPTS, HIT]], _greedy(),
                        use_tqdm=False)
    llm.shutdown()
    return path, [_answer(o) for o in outs]


def _answer(out) -> tuple[list[int], list[float]]:
    c = out.outputs[0]
    return list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]


def _same(got, want) -> bool:
    return got[0] == want[0] and max(abs(a - b) for a, b in zip(got[1], want[1])) < 1e-4


def _pair(path, sizes=(4, 4), **consumer_kw):
    producer = tiny_llm(path, block_size=sizes[0], kv_transfer_config={
        "kv_connector": "P2PConnector", "kv_role": "kv_producer", "kv_port": 0})
    consumer = tiny_llm(path, block_size=sizes[1], kv_transfer_config={
        "kv_connector": "P2PConnector", "kv_role": "kv_consumer"}, **consumer_kw)
    return producer, consumer


def _prefill(producer, prompts) -> list[dict]:
    outs = [producer.generate({"prompt_token_ids": p}, SamplingParams(
        temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        use_tqdm=False)[0] for p in prompts]
    return [o.kv_transfer_params for o in outs]


def _decode(consumer, prompts, params) -> list:
    return consumer.generate([{"prompt_token_ids": p} for p in prompts],
                             [_greedy(kv_transfer_params=kp) for kp in params], use_tqdm=False)


@pytest.mark.parametrize("sizes", [(4, 4), (8, 4)], ids=["same", "8-4"])
def test_decode_engine_gives_one_engines_tokens(v4, sizes) -> None:
    path, want = v4
    producer, consumer = _pair(path, sizes)
    try:
        params = _prefill(producer, PROMPTS)
        kept = producer.llm_engine.core.kv_connector._store
        layout = next(iter(kept.values())).payload.layout  # the 30-token prompt's
        # entries of the complete groups (7 CSA, 1 HCA), window rows from 30 - 8, the
        # compressors' open-group rows from the oldest group their next entry pools
        assert layout.ratios == [0, 0, 4, 0, 0, 16, 0, 0, 4, 0]
        assert [layout.layers[i][1] for i in (2, 5, 8)] == [7, 1, 7]
        assert layout.starts == [22, 22, 0, 22, 22, 0, 14, 22, 0, 22]
        outs = _decode(consumer, PROMPTS, params)
        connector = consumer.llm_engine.core.kv_connector
        assert connector.num_loaded == len(PROMPTS) and connector.num_failed == 0
        for out, w in zip(outs, want):
            assert _same(_answer(out), w)
            assert out.num_cached_tokens == len(out.prompt_token_ids) - 1  # loaded, not run
        # a prompt whose first 6 blocks the consumer computed itself: the rest is loaded
        # from token 24 (its HCA group's first 8 open rows are the consumer's own)
        consumer.generate({"prompt_token_ids": LOCAL}, SamplingParams(max_tokens=1),
                          use_tqdm=False)
        sched = consumer.llm_engine.core.scheduler
        starts: list[int] = []
        admit = sched.admission.connector.admitted

        def admitted(req, start, n, block_ids, group_block_ids=()) -> None:
            starts.append(start)
            admit(req, start, n, block_ids, group_block_ids)

        sched.admission.connector.admitted = admitted
        (out,) = _decode(consumer, [HIT], _prefill(producer, [HIT]))
        assert starts == [24] and connector.num_loaded == len(PROMPTS) + 1
        assert _same(_answer(out), want[-1]) and out.num_cached_tokens == len(HIT) - 1
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_every_kind_of_cache_a_decode_reads_is_loaded(v4) -> None:
    """Zeroing one kind of layer in the producer's kept payloads changes the consumer's
    answer: the decode reads what was loaded there (the consumer caches no prefix, so each
    round loads anew)."""
    path, want = v4
    producer, consumer = _pair(path, enable_prefix_caching=False)
    prompts = PROMPTS[:2]
    try:
        for layers in (WINDOW_ROWS, CSA_ENTRIES, HCA_ENTRIES, CSA_OPEN, HCA_OPEN):
            params = _prefill(producer, prompts)
            for kept in producer.llm_engine.core.kv_connector._store.values():
                layout, data = kept.payload.layout, np.frombuffer(kept.payload.data, np.uint8)
                at = np.cumsum([0] + [layout.layer_nbytes(i) for i in range(len(layout.layers))])
                for i in layers:
                    data[at[i]:at[i + 1]] = 0
            outs = _decode(consumer, prompts, params)
            assert consumer.llm_engine.core.kv_connector.num_failed == 0
            assert not all(_same(_answer(o), w) for o, w in zip(outs, want)), layers
    finally:
        producer.shutdown()
        consumer.shutdown()


ENTRY = 12  # values an entry


def _entries_of(kv: torch.Tensor, table: list[int], bs: int, ratio: int, n: int) -> torch.Tensor:
    """The first n entries as the model reads them (PagedEntries.load)."""
    reader = PagedEntries(ENTRY, ratio)
    reader.kv_cache = kv
    span = SimpleNamespace(tables=[torch.tensor(table)])
    return reader.load(SimpleNamespace(block_size=bs), span, n)


def test_entries_land_where_the_model_reads_them_across_block_sizes() -> None:
    """A window layer, CSA-like entries (ratio 4) and HCA-like sparse ones (ratio 16), blocks
    of 4 on the producer and 8 on the consumer, which loads tokens [8, 41) beside a prefix of
    its own: the entries it writes are the producer's, where PagedEntries reads them, and it
    writes none of those its prefix holds."""
    n, gen = 42, torch.Generator().manual_seed(0)
    specs = [SlidingSharedKVSpec(1, 8, 4, 8), CompressedEntrySpec(1, ENTRY, 4, ratio=4),
             CompressedEntrySpec(1, ENTRY, 4, ratio=16), CompressorStateSpec(1, 6, 4, 8)]
    groups = (KVCacheGroup(specs[1], (1,)), KVCacheGroup(specs[2], (2,)),
              KVCacheGroup(specs[0], (0, 3)))
    tables = LayerTables.of(groups, specs)
    assert tables.ratios == [0, 4, 16, 0] and tables.windows == (8, None, None, 8)

    def caches(bs: int, blocks: int) -> list[torch.Tensor]:
        return [torch.randn(1, bs * blocks, 1, s.slot_row(bs)[2], generator=gen) for s in specs]

    src = caches(4, 40)
    full = torch.randperm(39, generator=gen)[:11].add(1).tolist()
    sparse = [0, 0, 0, 31, 0, 0, 0, 32, 0, 0, 0]  # blocks closing a group of 16 (0: null)
    window = [0] * 8 + [34, 35, 36]
    payload = gather_rows(src, full, 4, n, tables, [sparse, window])
    assert [payload.layout.layers[i][1] for i in range(4)] == [8, 10, 2, 8]
    wire = KVLayout.from_wire(payload.layout.to_wire())
    assert wire == payload.layout
    KVRows("float32", [(1, 1, 32), (1, 1, 4 * ENTRY), (1, 1, 4 * ENTRY), (1, 1, 24)],
           (8, None, None, 8), (), (0, 4, 16, 0)).check(wire, 1)

    dst = [torch.zeros_like(kv) for kv in caches(8, 12)]
    d_full, d_sparse, d_window = [3, 7, 1, 9, 2, 11], [0, 4, 0, 6, 0, 10], [0] * 4 + [5, 8]
    scatter_rows(dst, wire, payload.data, d_full, 8, 8, n - 1 - 8, tables,
                 [d_sparse, d_window])
    for layer, ratio, s_table, d_table in ((1, 4, full, d_full), (2, 16, sparse, d_sparse)):
        got = _entries_of(dst[layer], d_table, 8, ratio, (n - 1) // ratio)
        sent = _entries_of(src[layer], s_table, 4, ratio, (n - 1) // ratio)
        own = 8 // ratio  # entries of the consumer's prefix: not written
        assert torch.equal(got[own:], sent[own:]) and not got[:own].any()
    # the window's rows from 41 - 8 + 1 = 34 on, in the consumer's blocks 4 and 5
    pos = torch.arange(34, n - 1)
    got = dst[0][0, torch.tensor(d_window)[pos // 8] * 8 + pos % 8]
    assert torch.equal(got, src[0][0, torch.tensor(window)[pos // 4] * 4 + pos % 4])

    other = KVLayout(wire.dtype, n, wire.layers, wire.starts, [], [0, 4, 0, 0])
    with pytest.raises(ValueError, match="compressed entries of ratios"):
        scatter_rows(dst, other, payload.data, d_full, 8, 8, n - 9, tables,
                     [d_sparse, d_window])
    with pytest.raises(ValueError, match="layer 2 has 2 entries of ratio 4"):
        KVLayout.from_wire({**wire.to_wire(), "ratios": [0, 4, 4, 0]})
