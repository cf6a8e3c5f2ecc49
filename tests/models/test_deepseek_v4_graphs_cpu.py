"""DeepSeek-V4's decode steps through CUDA graphs, on the CPU: the runner's capture path (decode
shapes only: decode_graphs_only) over the Triton backend's graph buffers, replays emulated
eagerly (worker/eager_graphs.py) under a guard that fails on any host read of a tensor
(`.tolist()`, `.item()`, a tensor's truth value, `nonzero`, boolean-mask indexing) in the
forward: what a real capture cannot replay. The capture runs over empty metadata (every row
padding, slot -1); before every replay the block tables are poisoned with other blocks' ids,
which a row may hold past its own blocks and a padding row holds whole. The tiny checkpoint of
test_deepseek_v4.py (fp32; window 8, CSA m = 4 with top-4, HCA m' = 16), three prompts past
the window and the groups, decoding through closing CSA and HCA groups, batches of 3 padded
to 4 rows, then 2 and 1: the eager engine's tokens, logprobs within 1e-5. The GPU run of the
same is tests/models/test_deepseek_v4_graphs_gpu.py. So is MTP's (k = 2): the drafter's second
greedy steps replay their graphs (decode steps of its sliding layer) under the same guard and
the output is the plain engine's."""

from __future__ import annotations

import functools
import os

import torch

# triton.jit reads TRITON_INTERPRET when a kernel is defined: set it before the engine
# imports the kernel modules (it does so lazily, when the Triton backend is chosen).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from models.test_deepseek_v4 import _prompts, tiny  # noqa: E402, F401 (fixture)
from models.test_deepseek_v4_mtp import ckpt  # noqa: E402, F401 (fixture)
from spec_decode.test_draft_graphs_cpu import EagerDraftGraphs  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from worker.eager_graphs import EagerGraphTable  # noqa: E402

from shoal import LLM, SamplingParams  # noqa: E402
from shoal.layers.moe.layer import FusedMoE  # noqa: E402
from shoal.layers.paged_rows import masked_put  # noqa: E402
from shoal.worker.model_graphs import ModelGraphs  # noqa: E402

cpu_only = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="CPU emulation (the GPU test is its CUDA run)")

# 9 tokens: decodes close HCA's group 0 (token 15) and CSA's 2, 3, 4; 22: CSA's 5 and 6; 30:
# HCA's group 1 (token 31) and CSA's 7 .. 10, past the indexer's top-4. Different lengths of
# output: a batch of 3 requests (4 rows, one padding), then 2, then 1.
LENGTHS, MAX_TOKENS = (9, 22, 30), (12, 8, 15)
_HOST_READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy",
               "nonzero", "masked_select", "unique", "argwhere"}


class NoHostReads(TorchFunctionMode):
    """Raises on a read of a tensor's values by the host. Paused inside the experts
    (FusedMoE's PyTorch path counts tokens per expert on the host; on CUDA its Triton
    kernels run, captured as in every MoE model's graphs)."""

    paused = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not NoHostReads.paused and (name in _HOST_READS or (
                name == "__getitem__" and _bool_index(args[1]))):
            raise AssertionError(f"a host read in a graph's forward: Tensor.{name}")
        return func(*args, **(kwargs or {}))


def _bool_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class GuardedGraphTable(EagerGraphTable):
    """Eager replays under NoHostReads; before each, every block table of the buffers holds
    random block ids of the pool (a step stages its rows' own blocks over them)."""

    max_block = 1  # set by the test: ids in [1, max_block) exist in every group
    replayed: list = []

    def capture(self, body, pool=None, what="step", before_each=None):
        def guarded(shape, tokens, md):
            with NoHostReads():
                return body(shape, tokens, md)

        return super().capture(guarded, pool, what, before_each)

    def stage(self, shape, *args, **kwargs):
        gen = torch.Generator().manual_seed(len(self.replayed))
        for buf in self.buffers:
            buf.block_tables.copy_(torch.randint(1, self.max_block, buf.block_tables.shape,
                                                 generator=gen))
        self.replayed.append(shape)
        return super().stage(shape, *args, **kwargs)


def _experts_unguarded(monkeypatch) -> None:
    forward = FusedMoE.forward

    def unguarded(self, *args, **kwargs):
        NoHostReads.paused += 1
        try:
            return forward(self, *args, **kwargs)
        finally:
            NoHostReads.paused -= 1

    monkeypatch.setattr(FusedMoE, "forward", unguarded)


def _generate(llm: LLM, prompts: list[list[int]]):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
              for n in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


@cpu_only
def test_decode_graphs_replay_the_eager_tokens(tiny, monkeypatch):  # noqa: F811
    path, _ = tiny
    prompts = _prompts(LENGTHS, seed=21)
    llm = LLM(model=str(path), dtype="float32", device="cpu", attention_backend="triton",
              block_size=4, max_num_batched_tokens=64, max_num_seqs=4,
              num_gpu_blocks_override=96, max_model_len=64, enable_prefix_caching=False)
    runner = llm.llm_engine.core.runner
    assert runner.graphs is None  # on the CPU the runner captures nothing: every step eager
    eager = _generate(llm, prompts)

    _experts_unguarded(monkeypatch)
    GuardedGraphTable.max_block = min(g.num_blocks for g in runner.kv_groups)
    GuardedGraphTable.replayed = []
    monkeypatch.setattr("shoal.worker.graph_capture.ModelGraphs",
                        functools.partial(ModelGraphs, table_type=GuardedGraphTable))
    runner._capture_graphs()  # over empty metadata: every row padding
    try:
        assert sorted(runner.graphs.table.graphs) == sorted(
            runner.graphs.table.shapes)  # every shape captured...
        assert {(s.rows, s.q) for s in runner.graphs.table.shapes} == {(1, 1), (2, 1), (4, 1)}
        graphed = _generate(llm, prompts)  # ...and only decode shapes: prefills run eagerly
    finally:
        runner.graphs = None
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    for g, e in zip(graphed, eager):
        for a, b in zip(g.logprobs, e.logprobs):
            (tok,) = a
            assert abs(a[tok].logprob - b[tok].logprob) < 1e-5
    rows = [s.rows for s in GuardedGraphTable.replayed]
    # every decode step replayed: 3 requests in 4 rows (one padding) while all decode
    assert rows.count(4) == min(MAX_TOKENS) - 1 and {1, 2} <= set(rows)
    assert len(rows) == max(MAX_TOKENS) - 1


class GuardedDraftGraphs(EagerDraftGraphs):
    """The drafter's step under NoHostReads (its buffers poisoned before each run)."""

    def __init__(self, step, *args, **kwargs):
        def guarded(*a):
            with NoHostReads():
                return step(*a)

        super().__init__(guarded, *args, **kwargs)


@cpu_only
def test_mtp_drafts_replay_their_graphs_losslessly(ckpt, monkeypatch):  # noqa: F811
    target, _ = ckpt
    _experts_unguarded(monkeypatch)
    prompts = [{"prompt_token_ids": p} for p in _prompts(LENGTHS, seed=22)]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    engine = dict(dtype="float32", block_size=4, max_model_len=64, num_gpu_blocks_override=96,
                  max_num_seqs=4, enable_prefix_caching=False)
    plain = [o.outputs[0].token_ids
             for o in LLM(model=str(target), **engine).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(model=str(target), attention_backend="triton", **engine,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    drafter = llm.llm_engine.core.runner.drafter
    drafter.capture_graphs(None, 64 // 4, GuardedDraftGraphs)
    assert drafter.graphs.sizes == [1, 2, 4]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert got == plain
    assert (3, 4, 1) in drafter.graphs.runs  # 3 requests padded to 4 rows, one draft step


def test_masked_put_writes_only_the_kept_rows():
    dest = torch.arange(24.0).view(6, 4)
    values = -torch.arange(1.0, 13.0).view(3, 4)
    before = dest.clone()
    # row 1 kept; rows 0 and 2 (slot -1, or any slot) change nothing
    masked_put(dest, (torch.tensor([-1, 4, 2]),), values, torch.tensor([False, True, False]))
    expected = before.clone()
    expected[4] = values[1]
    assert torch.equal(dest, expected)
    # none kept: nothing changes (row 0 is written back as it was)
    masked_put(dest, (torch.tensor([-1, -1, 5]),), values, torch.zeros(3, dtype=torch.bool))
    assert torch.equal(dest, expected)
    # two-dimensional places (block, slot), every row kept
    pages = torch.zeros(3, 2, 4)
    masked_put(pages, (torch.tensor([2, 0, 1]), torch.tensor([1, 0, 1])), values,
               torch.ones(3, dtype=torch.bool))
    assert torch.equal(pages[2, 1], values[0]) and torch.equal(pages[0, 0], values[1])
    assert torch.equal(pages[1, 1], values[2]) and pages.abs().sum() == values.abs().sum()
