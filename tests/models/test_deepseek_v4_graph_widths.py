"""DeepSeek-V4's decode graphs per block-table width (decode_table_buckets_from): its decodes
score or attend every compressed entry their tables could hold, so a step replays the
narrowest captured width that holds its longest request instead of max_model_len.

On the CPU, as test_deepseek_v4_graphs_cpu.py: the runner's capture path over the Triton
backend's graph buffers, replays emulated eagerly under the guard against host reads, the
buffers' tables poisoned with random blocks before every replay (a narrow graph reads only
its first columns; a row's columns past its own blocks hold others'). The tiny checkpoint of
test_deepseek_v4.py, block size 4, max_model_len 128 (32 blocks), widths from 16 tokens: 4, 8
and 16 blocks, and the whole table. A request of 9 prompt tokens beside one of 30 decodes in
the 30-token one's width (8 blocks, then 16 once it passes 32 tokens), then alone in its own
(4 blocks, then 8 past 16 tokens): the eager engine's tokens and those of graphs of the whole
width only, logprobs within 1e-5; every step's width is the one its longest request needs, and
its CSA indexers score the entries of that width only. On a GPU (skipped without one) the same
with real captures, against enforce_eager:

    .venv/bin/python -m pytest -q tests/models/test_deepseek_v4_graph_widths.py"""

from __future__ import annotations

import functools

import pytest
import torch
from models.test_deepseek_v4 import _prompts, tiny  # noqa: F401 (fixture)
from models.test_deepseek_v4_graphs_cpu import (
    GuardedGraphTable,
    _experts_unguarded,
    cpu_only,
)

from shoal import LLM, SamplingParams
from shoal.attention.triton_backend import TritonAttentionBackend
from shoal.layers.compressed_indexer import CompressedIndexer
from shoal.layers.request_spans import StepSpans
from shoal.models.deepseek_v4 import DeepseekV4ForCausalLM
from shoal.worker.graph_table import GraphTable, StepShape
from shoal.worker.model_graphs import ModelGraphs, step_shapes, table_widths

BS, MAX_LEN = 4, 128
LENGTHS, MAX_TOKENS = (9, 30), (16, 5)


class RecordedGraphTable(GuardedGraphTable):
    """GuardedGraphTable that keeps each replay's shape and its requests' context lengths."""

    steps: list[tuple[StepShape, list[int]]] = []

    def stage(self, shape, token_rows, context_lens, *args, **kwargs):
        self.steps.append((shape, list(context_lens)))
        return super().stage(shape, token_rows, context_lens, *args, **kwargs)


def _expected_width(longest_seq: int) -> int:
    """The narrowest of 4, 8, 16 blocks holding longest_seq tokens, else 0 (the whole)."""
    need = -(-longest_seq // BS)
    return next((w for w in (4, 8, 16) if w >= need), 0)


SCORED: list[int] = []  # entries each CSA layer's indexer scored per decode row, in order


def _record_scored(monkeypatch) -> None:
    pick = CompressedIndexer.pick

    def recorded(self, q, weights, keys, visible):
        if keys.dim() == 3:  # a batch of decodes: [n, entries, index_head_dim]
            SCORED.append(keys.shape[1])
        return pick(self, q, weights, keys, visible)

    monkeypatch.setattr(CompressedIndexer, "pick", recorded)


def _graphed(llm: LLM, prompts, params, buckets_from: int | None, monkeypatch):
    runner = llm.llm_engine.core.runner
    monkeypatch.setattr(DeepseekV4ForCausalLM, "decode_table_buckets_from", buckets_from)
    GuardedGraphTable.replayed = []
    runner._capture_graphs()
    RecordedGraphTable.steps = []
    SCORED.clear()
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0] for o in outs], runner.graphs.table.shapes
    finally:
        runner.graphs = None


@cpu_only
def test_decode_graphs_replay_the_narrowest_width_that_holds_the_batch(tiny, monkeypatch):  # noqa: F811
    path, _ = tiny
    prompts = [{"prompt_token_ids": p} for p in _prompts(LENGTHS, seed=31)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
              for n in MAX_TOKENS]
    llm = LLM(model=str(path), dtype="float32", device="cpu", attention_backend="triton",
              block_size=BS, max_num_batched_tokens=64, max_num_seqs=2,
              num_gpu_blocks_override=48, max_model_len=MAX_LEN, enable_prefix_caching=False)
    runner = llm.llm_engine.core.runner
    eager = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]

    _experts_unguarded(monkeypatch)
    _record_scored(monkeypatch)
    GuardedGraphTable.max_block = min(g.num_blocks for g in runner.kv_groups)
    monkeypatch.setattr("shoal.worker.graph_capture.ModelGraphs",
                        functools.partial(ModelGraphs, table_type=RecordedGraphTable))
    whole, shapes = _graphed(llm, prompts, params, None, monkeypatch)
    assert {s.blocks for s in shapes} == {0}
    assert {s.blocks for s, _ in RecordedGraphTable.steps} == {0}
    # two CSA layers per step, each scoring every entry 33 blocks hold (m = 4 = block size)
    assert SCORED == [MAX_LEN // BS + 1] * 2 * len(RecordedGraphTable.steps)

    narrow, shapes = _graphed(llm, prompts, params, 4 * BS, monkeypatch)
    assert {(s.rows, s.blocks) for s in shapes} == {(r, w) for r in (1, 2)
                                                    for w in (0, 4, 8, 16)}
    steps = RecordedGraphTable.steps
    assert len(steps) == max(MAX_TOKENS) - 1  # every decode step replayed a graph
    widths = [s.blocks for s, _ in steps]
    assert widths == [_expected_width(max(ctx) + 1) for _, ctx in steps]
    # both decode: 8 blocks, then 16 once the long one passes 32 tokens; then the short one
    # alone: 4 blocks up to 16 tokens, then 8
    assert widths == [8] * 2 + [16] * 2 + [4] * 3 + [8] * 8
    assert [s.rows for s, _ in steps] == [2] * 4 + [1] * 11
    assert SCORED == [w for w in widths for _ in range(2)]  # the narrow tables' entries

    for out in (whole, narrow):
        assert [o.token_ids for o in out] == [o.token_ids for o in eager]
        for got, ref in zip(out, eager):
            for a, b in zip(got.logprobs, ref.logprobs):
                (tok,) = a
                assert abs(a[tok].logprob - b[tok].logprob) < 1e-5


def _recording(run, steps: list):
    """ModelGraphs.run that first keeps the shape and its requests' context lengths."""
    def recorded(shape, inp, *args, **kwargs):
        steps.append((shape, inp.context_lens()))
        return run(shape, inp, *args, **kwargs)

    return recorded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_narrow_cuda_graphs_give_the_eager_tokens(tiny, monkeypatch):  # noqa: F811
    """The same on a GPU: real captures of every width (their tables views of the buffers'
    first columns), against the same engine with enforce_eager."""
    path, _ = tiny
    monkeypatch.setattr(DeepseekV4ForCausalLM, "decode_table_buckets_from", 4 * BS)
    prompts = [{"prompt_token_ids": p} for p in _prompts(LENGTHS, seed=31)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
              for n in MAX_TOKENS]
    outs, steps = {}, []
    for eager in (True, False):
        llm = LLM(model=str(path), dtype="float32", block_size=BS, max_num_seqs=2,
                  max_num_batched_tokens=64, num_gpu_blocks_override=48,
                  max_model_len=MAX_LEN, enable_prefix_caching=False, enforce_eager=eager)
        graphs = llm.llm_engine.core.runner.graphs
        if graphs is not None:
            graphs.run = _recording(graphs.run, steps)
        outs[eager] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.shutdown()
        del llm, graphs
        torch.cuda.empty_cache()
    widths = [s.blocks for s, _ in steps]
    assert widths == [_expected_width(max(ctx) + 1) for _, ctx in steps]
    assert {4, 8, 16} <= set(widths)
    assert [o.token_ids for o in outs[False]] == [o.token_ids for o in outs[True]]
    for got, ref in zip(outs[False], outs[True]):
        for a, b in zip(got.logprobs, ref.logprobs):
            (tok,) = a
            assert abs(a[tok].logprob - b[tok].logprob) < 1e-4


@cpu_only
def test_eager_decodes_beside_a_long_chunk_read_their_own_width(tiny, monkeypatch):  # noqa: F811
    """Eagerly (Triton backend's metadata: one table width for the step) a decode beside a
    longer prompt's chunk reads its tables cut to the longest decode's blocks: the torch
    backend's tokens (its decode tables are the decodes' own width), logprobs within 1e-5."""
    path, _ = tiny
    prompts = [{"prompt_token_ids": p} for p in _prompts((9, 90), seed=32)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
              for n in (8, 4)]
    of_triton = StepSpans._of_triton.__func__
    mixed: list[tuple[int, int]] = []  # (decode tables' width, the step's table width)

    def recorded(cls, mds, positions):
        step = of_triton(cls, mds, positions)
        if step.num_decodes and step.spans:
            mixed.append((step.decode_tables[0].shape[1], mds[0].block_tables.shape[1]))
        return step

    monkeypatch.setattr(StepSpans, "_of_triton", classmethod(recorded))
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(model=str(path), dtype="float32", device="cpu", attention_backend=backend,
                  block_size=BS, max_num_batched_tokens=32, max_num_seqs=2,
                  num_gpu_blocks_override=48, max_model_len=MAX_LEN,
                  enable_prefix_caching=False)
        outs[backend] = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    # the short prompt decodes while the long one's chunks run: 10 .. 13 tokens (4 blocks),
    # the chunks' tables up to 90 tokens (23 blocks)
    assert mixed and all(d <= 4 < w for d, w in mixed)
    assert [o.token_ids for o in outs["triton"]] == [o.token_ids for o in outs["torch"]]
    for got, ref in zip(outs["triton"], outs["torch"]):
        for a, b in zip(got.logprobs, ref.logprobs):
            (tok,) = a
            assert abs(a[tok].logprob - b[tok].logprob) < 1e-5


def test_table_widths_double_below_the_whole_table():
    assert table_widths(32, 4) == [4, 8, 16]
    assert table_widths(63, 4) == [4, 8, 16]  # 32 blocks: about the whole table's work
    assert table_widths(8202, 128) == [128, 256, 512, 1024, 2048, 4096]  # 128k, bs 16
    assert table_widths(8, 16) == []
    with pytest.raises(ValueError, match="narrowest"):
        table_widths(8, 0)
    shapes = step_shapes(2, 64, prefill=False, decode_widths=[4, 8])
    assert sorted((s.rows, s.blocks) for s in shapes) == [(1, 0), (1, 4), (1, 8), (2, 0),
                                                          (2, 4), (2, 8)]


def test_narrow_graphs_read_the_first_columns_and_refuse_longer_requests():
    backend = TritonAttentionBackend()
    buf = backend.alloc_graph_buffers(4, 4, 16, torch.device("cpu"), block_size=BS,
                                      sliding_window=None)
    md = backend.graph_metadata(buf, 2, 1, blocks=4)
    assert md.block_tables.shape == (2, 4) and md.max_seq_len == 4 * BS
    assert md.block_tables.data_ptr() == buf.block_tables.data_ptr()  # a view: staged rows
    assert backend.graph_metadata(buf, 2, 1).block_tables.shape == (2, 16)
    with pytest.raises(ValueError, match="blocks"):
        backend.graph_metadata(buf, 2, 1, blocks=17)
    with pytest.raises(ValueError, match="blocks"):
        GraphTable(backend, [StepShape(1, 1, 1, 17)], 16, torch.device("cpu"), block_size=BS)
    narrow = StepShape(1, 1, 1, 4)
    table = GraphTable(backend, [narrow], 16, torch.device("cpu"), block_size=BS)
    table.stage(narrow, ([5], [15], [0]), [15], [[list(range(1, 8))]], [[4 * BS - 1]])
    with pytest.raises(ValueError, match="17 tokens"):  # a 17th token needs a 5th block
        table.stage(narrow, ([5], [16], [0]), [16], [[list(range(1, 8))]], [[5 * BS]])
