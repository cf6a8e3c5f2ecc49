"""DeepSeek-V3.2's decode graphs per block-table width (decode_table_buckets_from: the
checkpoint's index_topk): in a graph the indexer scores every position the tables could hold
and is skipped only when they hold at most index_topk, so a step replays the narrowest captured
width that holds its longest request instead of max_model_len's.

On the CPU, as test_deepseek_v4_graph_widths.py (whose helpers it imports): the runner's
capture path over the Triton backend's graph buffers, replays emulated eagerly under the guard
against host reads, the buffers' tables poisoned with random blocks before every replay (a
narrow graph reads only its first columns). The tiny checkpoint of test_deepseek_v32.py
(index_topk 8), block size 4, max_model_len 64 (16 blocks): widths of 2, 4 and 8 blocks, and
the whole table. A request of 13 prompt tokens beside one of 2 decodes in the long one's width
(4 blocks, then 8 once it passes 16 tokens), then the short one alone in 2 blocks (7 and 8
tokens: within top-k), where the indexer scores nothing (at the whole width it would score 20
columns a step); each layer's indexer scores only its step's width: the eager engine's tokens,
logprobs within 1e-5. Eager steps score decodes beside a longer prompt's chunk over their own
columns, not the chunk's. On a GPU (skipped without one) the same with real captures, against
enforce_eager:

    python3 -m pytest -q -rf tests/models/test_deepseek_v32_graph_widths.py"""

from __future__ import annotations

import functools

import pytest
import torch
from models.test_deepseek_v4_graph_widths import RecordedGraphTable, _recording
from models.test_deepseek_v4_graphs_cpu import (
    GuardedGraphTable,
    _experts_unguarded,
    cpu_only,
)
from models.test_deepseek_v32 import V32, _prompts, tiny  # noqa: F401 (fixture)

from shoal import LLM, SamplingParams
from shoal.layers import sparse_picks
from shoal.worker.model_graphs import ModelGraphs

BS, MAX_LEN, TOPK = 4, 64, V32["index_topk"]
LENGTHS, MAX_TOKENS = (2, 13), (7, 5)
# a prefill graph of 16 tokens: the whole tables are 16 + 16 / BS columns wide
WHOLE = MAX_LEN // BS + 16 // BS
ENGINE = dict(dtype="float32", block_size=BS, max_num_batched_tokens=16, max_num_seqs=2,
              num_gpu_blocks_override=48, max_model_len=MAX_LEN, enable_prefix_caching=False)


class PoisonedGraphTable(RecordedGraphTable):
    """RecordedGraphTable whose replays each copy their block tables over the poison: with no
    sliding group a steady decode batch keeps the tables of its last stage (copied every
    block_size steps), which GuardedGraphTable has just overwritten."""

    def stage(self, *args, **kwargs):
        self.invalidate_tables()
        return super().stage(*args, **kwargs)


def _expected_width(longest_seq: int) -> int:
    """The narrowest of 2, 4, 8 blocks holding longest_seq tokens, else 0 (the whole)."""
    need = -(-longest_seq // BS)
    return next((w for w in (2, 4, 8) if w >= need), 0)


def _requests():
    prompts = [{"prompt_token_ids": p} for p in _prompts(LENGTHS, seed=41)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
              for n in MAX_TOKENS]
    return prompts, params


def _record_picks(monkeypatch, calls: list) -> None:
    """pick_rows (the indexer's scores and top-k on the Triton backend's metadata) that first
    keeps, for a graph's metadata (no host_lens), the replay it runs in and its table width."""
    pick = sparse_picks.pick_rows

    def recorded(q, weights, md, *args, **kwargs):
        if md.host_lens is None:
            calls.append((len(RecordedGraphTable.steps) - 1, md.block_tables.shape[1]))
        return pick(q, weights, md, *args, **kwargs)

    monkeypatch.setattr(sparse_picks, "pick_rows", recorded)


def _same_tokens(got, ref, tol: float) -> None:
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for g, r in zip(got, ref):
        for a, b in zip(g.logprobs, r.logprobs):
            (tok,) = a
            assert abs(a[tok].logprob - b[tok].logprob) < tol


@cpu_only
def test_decode_graphs_replay_the_narrowest_width_and_skip_the_indexer_within_topk(
        tiny, monkeypatch):  # noqa: F811
    path, _ = tiny
    llm = LLM(model=str(path), device="cpu", attention_backend="triton", **ENGINE)
    runner = llm.llm_engine.core.runner
    assert runner.model.decode_table_buckets_from == TOPK  # the checkpoint's
    eager = [o.outputs[0] for o in llm.generate(*_requests(), use_tqdm=False)]

    _experts_unguarded(monkeypatch)
    picks: list[tuple[int, int]] = []  # (replay, table columns) of each graph pick_rows
    _record_picks(monkeypatch, picks)
    # (one KV cache group, sharing the pool: its num_blocks is 0)
    GuardedGraphTable.max_block = ENGINE["num_gpu_blocks_override"]
    monkeypatch.setattr("shoal.worker.graph_capture.ModelGraphs",
                        functools.partial(ModelGraphs, table_type=PoisonedGraphTable))
    GuardedGraphTable.replayed, RecordedGraphTable.steps = [], []
    runner._capture_graphs()
    assert {(s.rows, s.blocks) for s in runner.graphs.table.shapes if s.q == 1} == {
        (r, w) for r in (1, 2) for w in (0, 2, 4, 8)}
    assert {w for _, w in picks} == {4, 8, WHOLE}  # captured: none in 2 blocks (top-k)
    picks.clear()
    try:
        narrow = [o.outputs[0] for o in llm.generate(*_requests(), use_tqdm=False)]
    finally:
        runner.graphs = None
    steps = RecordedGraphTable.steps
    widths = [s.blocks for s, _ in steps]
    assert widths == [_expected_width(max(ctx) + 1) for _, ctx in steps]
    # both decode: 4 blocks, then 8 once the long one passes 16 tokens; then the short one
    # alone in 2 blocks (7 and 8 tokens), within top-k
    assert widths == [4, 4, 4, 8, 2, 2] and [s.rows for s, _ in steps] == [2] * 4 + [1] * 2
    # the narrow tables' positions scored, and nothing in the steps within top-k
    assert picks == [(i, w) for i, w in enumerate(widths) if w * BS > TOPK
                     for _ in range(V32["num_hidden_layers"])]
    _same_tokens(narrow, eager, 1e-5)


@cpu_only
def test_eager_decodes_beside_a_long_chunk_score_their_own_columns(tiny, monkeypatch):  # noqa: F811
    """Eagerly (the Triton backend's metadata: one table width for the step) the decode rows
    beside a longer prompt's chunk are scored in a piece of their own columns (at most twice
    the longest decode's blocks), not the chunk's: the torch backend's tokens (its decode
    tables are the decodes' own width), logprobs within 1e-5."""
    path, _ = tiny
    prompts = [{"prompt_token_ids": p} for p in _prompts((10, 40), seed=42)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
              for n in (8, 2)]
    pieces = sparse_picks.score_pieces
    mixed: list[tuple[int, int, int]] = []  # (decode piece's columns, decode blocks, step's)

    def recorded(md, rows, topk, device):
        got = pieces(md, rows, topk, device)
        if md.num_decode_rows and md.num_prefills:
            first = next(p for p in got if p.start == 0)
            longest = max(c + n for n, c in md.host_lens[:md.num_decode_rows])
            mixed.append((first.columns, -(-longest // BS), md.block_tables.shape[1]))
        return got

    monkeypatch.setattr(sparse_picks, "score_pieces", recorded)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(path), device="cpu", attention_backend=backend, **ENGINE)
        outs[backend] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    # the short prompt decodes (11 .. 13 tokens) while the long one's chunks run (to 40)
    assert mixed and all(d <= 2 * blocks for d, blocks, _ in mixed)
    assert any(2 * blocks < w for _, blocks, w in mixed)  # the step's tables wider
    _same_tokens(outs["triton"], outs["torch"], 1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_narrow_cuda_graphs_give_the_eager_tokens(tiny, monkeypatch):  # noqa: F811
    """The same on a GPU: real captures of every width (their tables views of the buffers'
    first columns; the decode graphs of 2 blocks captured without the indexer's picks),
    against the same engine with enforce_eager."""
    path, _ = tiny
    captured: set[int] = set()  # table columns of decode graphs whose capture ran pick_rows
    pick = sparse_picks.pick_rows

    def recorded(q, weights, md, *args, **kwargs):
        if md.host_lens is None and md.num_decodes:
            captured.add(md.block_tables.shape[1])
        return pick(q, weights, md, *args, **kwargs)

    monkeypatch.setattr(sparse_picks, "pick_rows", recorded)
    outs, steps = {}, []
    for eager in (True, False):
        llm = LLM(model=str(path), enforce_eager=eager, **ENGINE)
        graphs = llm.llm_engine.core.runner.graphs
        if graphs is not None:
            graphs.run = _recording(graphs.run, steps)
        outs[eager] = [o.outputs[0] for o in llm.generate(*_requests(), use_tqdm=False)]
        llm.shutdown()
        del llm, graphs
        torch.cuda.empty_cache()
    assert captured == {4, 8, WHOLE}  # 2 blocks hold top-k: no picks captured there
    widths = [s.blocks for s, _ in steps]
    assert widths == [_expected_width(max(ctx) + 1) for _, ctx in steps]
    assert {2, 4, 8} <= set(widths)
    _same_tokens(outs[False], outs[True], 1e-4)
