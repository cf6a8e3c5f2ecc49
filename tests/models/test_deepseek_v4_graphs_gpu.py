"""DeepSeek-V4 with CUDA graphs on a GPU (skipped without one): the tiny fp32 checkpoints of
test_deepseek_v4.py and test_deepseek_v4_mtp.py. At start-up the runner captures decode
shapes only (decode_graphs_only); decode batches (5 requests padded to 8 rows, then fewer)
replay them and give the tokens of the same engine with enforce_eager, logprobs within 1e-4;
prompts past the window, CSA's top-k and HCA's group of 16, decoding through closing groups.
With MTP drafts (k = 2) the drafter's greedy steps past the first replay their graphs too,
and the output is the plain eager engine's. The CPU emulation of the same is
tests/models/test_deepseek_v4_graphs_cpu.py.

    .venv/bin/python -m pytest -q tests/models/test_deepseek_v4_graphs_gpu.py"""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from models.test_deepseek_v4 import _prompts, tiny  # noqa: E402, F401 (fixture)
from models.test_deepseek_v4_mtp import ckpt  # noqa: E402, F401 (fixture)

from shoal import LLM, SamplingParams  # noqa: E402

LENGTHS, MAX_TOKENS = (5, 9, 22, 30, 61), (20, 12, 8, 16, 10)
ENGINE = dict(dtype="float32", block_size=4, max_num_batched_tokens=128, max_num_seqs=8,
              num_gpu_blocks_override=256, max_model_len=128)


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
            for n in MAX_TOKENS]


def _run(path, enforce_eager: bool, **kw):
    """(each request's output, the shape of every step replayed from a graph, the drafter's
    graph runs or None)."""
    llm = LLM(model=str(path), enforce_eager=enforce_eager, **ENGINE, **kw)
    runner = llm.llm_engine.core.runner
    replays: list = []
    if runner.graphs is not None:
        assert all(s.q == 1 for s in runner.graphs.table.shapes)  # decode graphs only
        real_run = runner.graphs.run
        runner.graphs.run = lambda shape, *a: replays.append(shape) or real_run(shape, *a)
    drafts = None
    drafter = getattr(runner, "drafter", None)
    if drafter is not None and drafter.graphs is not None:
        drafts = []
        real_draft = drafter.graphs.run
        drafter.graphs.run = lambda ids, *a: drafts.append(len(ids)) or real_draft(ids, *a)
    prompts = [{"prompt_token_ids": p} for p in _prompts(LENGTHS, seed=31)]
    outs = [o.outputs[0] for o in llm.generate(prompts, _params(), use_tqdm=False)]
    llm.shutdown()
    del llm, runner, drafter
    gc.collect()
    torch.cuda.empty_cache()
    return outs, replays, drafts


def test_decode_graphs_give_the_eager_tokens(tiny):  # noqa: F811
    path, _ = tiny
    graphed, replays, _ = _run(path, enforce_eager=False)
    eager, none, _ = _run(path, enforce_eager=True)
    assert none == []
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    for g, e in zip(graphed, eager):
        for a, b in zip(g.logprobs, e.logprobs):
            (tok,) = a
            assert abs(a[tok].logprob - b[tok].logprob) < 1e-4
    rows = [s.rows for s in replays]
    assert 8 in rows and 1 in rows  # 5 requests padded to 8 rows; the last one alone
    assert len(rows) >= max(MAX_TOKENS) - 2  # (a step may hold a prefill: eager)


def test_mtp_drafts_through_graphs_give_the_eager_tokens(ckpt):  # noqa: F811
    target, _ = ckpt
    plain, _, _ = _run(target, enforce_eager=True)
    spec, _, drafts = _run(target, enforce_eager=False,
                           speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert drafts  # the drafter's second steps replayed their graphs
