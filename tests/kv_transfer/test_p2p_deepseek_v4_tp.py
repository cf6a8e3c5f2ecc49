"""Prefill/decode disaggregation of DeepSeek-V4 between engines of 1 and 2 tensor-parallel
ranks (gloo, the mp executor), its MTP drafter on both sides (the tiny checkpoint of
models/test_deepseek_v4_mtp.py: a sliding, a CSA and an HCA layer, a window of 8, fp32), with
the "auto" and the FP8 KV cache (kv_cache_dtype="fp8": block-scaled e4m3 window rows and
entries, moved as their bytes).

V4's caches are whole on every rank (one KV head, replicated: its window rows, its compressed
entries with CSA's indexer keys, its compressors' open-group rows, the MTP block's window
rows): a two-rank producer reads them out on rank 0 alone (nothing gathered between its
ranks), its payload holds them once, as a one-rank producer's, and every rank of a two-rank
consumer writes all of it. The consumer's greedy tokens are one one-rank engine's, its prompt
loaded (all but the last token), its drafter warm (one engine's accepted drafts)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from engine_helpers import tiny_llm
from models.test_deepseek_v4_mtp import ckpt  # noqa: F401 (the fixture)
from spec_decode.test_spec_engine import SpecCounter

from shoal import SamplingParams
from shoal.core.kv_cache_spec import (
    CompressedEntrySpec,
    FullAttentionSpec,
    KVCacheGroup,
    SlidingSharedKVSpec,
)
from shoal.kv_transfer import rows as rows_module
from shoal.kv_transfer import tp_rows
from shoal.kv_transfer.rows import LayerTables, gather_rows

STEPS = 8
SPEC = {"method": "mtp", "num_speculative_tokens": 2}
_rng = random.Random(6)
# ending inside a CSA group, on an HCA group's last token, shorter than the window
PROMPTS = [[_rng.randrange(3, 512) for _ in range(n)] for n in (30, 32, 7)]
MORE = [[_rng.randrange(3, 512) for _ in range(n)] for n in (37, 16)]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **kw)


def _both(path, **kw):
    return tiny_llm(path, speculative_config=SPEC, kv_transfer_config={
        "kv_connector": "P2PConnector", "kv_role": "kv_both", "kv_port": 0}, **kw)


def _prefill(llm, prompts) -> list[dict]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(
        temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        use_tqdm=False)
    params = [o.kv_transfer_params for o in outs]
    assert [kp["remote_num_tokens"] for kp in params] == [len(p) for p in prompts]
    return params


def _generate(llm, prompts, params=None) -> tuple[list, int]:
    """The outputs and the drafts accepted."""
    counter = SpecCounter(llm)
    sps = [_greedy(kv_transfer_params=kp) for kp in params] if params else _greedy()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    return outs, counter.accepted


def _decode(llm, prompts, params) -> tuple[list[list[int]], int]:
    """The tokens, each prompt loaded (all but its last token, nothing computed), and the
    drafts accepted."""
    outs, accepted = _generate(llm, prompts, params)
    assert [o.num_cached_tokens for o in outs] == [len(p) - 1 for p in prompts]
    assert llm.llm_engine.core.kv_connector.num_loaded == len(prompts)
    runner = llm.llm_engine.core.runner
    draft = getattr(runner, "driver", runner)._connector_layout()[2]
    assert (draft.num_loaded, draft.num_zeroed) == (len(prompts), 0)  # rank 0's drafter
    return [list(o.outputs[0].token_ids) for o in outs], accepted


def _kept(llm) -> list:
    return [k.payload.layout for k in llm.llm_engine.core.kv_connector._store.values()]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_one_to_two_and_two_to_one_ranks(ckpt, kv_cache_dtype, monkeypatch) -> None:  # noqa: F811
    """As test_p2p_engines' two-rank test: two engines in one process share
    torch.distributed's world, so the one-rank engine prefills before the two-rank one starts
    and decodes once that one's ranks have stopped (its connector still serving). The
    two-rank engine has blocks of 8, the one-rank one of 4."""
    path, _ = ckpt
    gathers: list[int] = []  # (rank 0 runs in this process: the driver)
    gather = rows_module.gather_to_first
    monkeypatch.setattr(rows_module, "gather_to_first",
                        lambda local, reps: gathers.append(len(local)) or gather(local, reps))
    one = _both(path, kv_cache_dtype=kv_cache_dtype)
    two = None
    try:
        outs, accepted = _generate(one, PROMPTS + MORE)
        want = [list(o.outputs[0].token_ids) for o in outs]
        assert one.reset_prefix_cache()
        params = _prefill(one, PROMPTS)
        sent = _kept(one)
        two = _both(path, kv_cache_dtype=kv_cache_dtype, tensor_parallel_size=2, block_size=8)
        assert two.llm_engine.core.kv_connector.engine.ranks_share_memory
        got, accepted_two = _decode(two, PROMPTS, params)
        assert got == want[:len(PROMPTS)]

        params = _prefill(two, MORE)
        sent += _kept(two)
        assert not gathers  # every cache is replicated: rank 0 read them alone
        dtype = "float8_e4m3fn" if kv_cache_dtype == "fp8" else "float32"
        for layout in sent:  # one head of each layer and of the drafter's: each sent once
            assert layout.dtype == dtype and layout.draft.dtype == "float32"
            assert all(heads == 1 for _, _, heads, _ in layout.layers + layout.draft.layers)
        two.llm_engine.core.runner.shutdown()
        got, accepted_one = _decode(one, MORE, params)
        assert got == want[len(PROMPTS):]
        assert accepted_two + accepted_one == accepted > 0  # warm drafters
    finally:
        one.shutdown()
        if two is not None:
            two.shutdown()


def test_rank_zero_reads_replicated_layers_alone_and_gathers_split_ones(monkeypatch) -> None:
    """Rank 0 of two: a layer of 2 KV heads split over the ranks is gathered; a V4 window
    layer and an entries layer (whole on every rank) are not: rank 0's own rows go into the
    payload, once. With no split layer the ranks skip the collective: rank 1 gets None at
    once."""
    specs = [FullAttentionSpec(1, 4, 4), SlidingSharedKVSpec(1, 8, 4, 8),
             CompressedEntrySpec(1, 8, 4, ratio=4)]
    groups = [KVCacheGroup(s, (i,)) for i, s in enumerate(specs)]
    gen = torch.Generator().manual_seed(0)
    ranks = [[torch.randn(p, 16, h, d, generator=gen) for p, h, d in
              (s.slot_row(4) for s in specs)] for _ in range(2)]  # 4 blocks of 4 a rank
    monkeypatch.setattr(rows_module, "get_tp_world_size", lambda: 2)
    monkeypatch.setattr(rows_module, "get_tp_rank", lambda: 0)
    tables = LayerTables.of(groups, specs, SimpleNamespace(num_key_value_heads=2))
    assert tables.replicas == (1, 2, 2)
    n, table = 8, [1, 2]

    def rows_of(rank: int, layer: int) -> torch.Tensor:
        return rows_module._read_layer(ranks[rank][layer], layer, tables, rows_module._Slots(
            [table] * 3, 4, torch.device("cpu")), 0, n)

    sent: list[int] = []

    def gather(flat: torch.Tensor) -> list[torch.Tensor]:  # rank 1's split rows beside ours
        sent.append(flat.numel())
        return [flat, rows_of(1, 0).reshape(-1)]

    monkeypatch.setattr(tp_rows, "tp_gather_to_first", gather)
    payload = gather_rows(ranks[0], table, 4, n, tables, [table, table])
    assert sent == [2 * n * 16]  # the split layer's rows alone
    layout = payload.layout
    assert layout.layers == [[2, n, 2, 16], [1, n, 1, 32], [1, n // 4, 1, 32]]
    host = torch.frombuffer(bytearray(payload.data), dtype=torch.uint8)
    at = 0
    for i in range(3):
        size = layout.layer_nbytes(i)
        want = torch.cat([rows_of(0, 0), rows_of(1, 0)], dim=2) if i == 0 else rows_of(0, i)
        assert torch.equal(host[at:at + size].view(layout.layers[i]), want)
        at += size

    replicated = LayerTables(tables.groups[1:], tables.windows[1:], (), tables.replicas[1:],
                             tables.entries[1:])
    monkeypatch.setattr(rows_module, "get_tp_rank", lambda: 1)
    assert gather_rows(ranks[1][1:], table, 4, n, replicated, [table, table]) is None
    assert sent == [2 * n * 16]  # no collective
