"""Hybrid models (Qwen3.5's Gated DeltaNet, Kimi Linear's KDA) with speculative decoding and
CUDA graphs on a GPU (skipped without one): the tiny fp32 checkpoints and scripted ngram
drafts of tests/worker/test_hybrid_verify_graphs_cpu.py (all accepted, all rejected, the
last rejected, none: a decode that folds a replay). At start-up the runner captures decode
and verify shapes; verify steps (3 requests padded to 4 rows) and replay-folding decodes
replay the verify graphs and give the tokens of the same engine with enforce_eager (logprobs
within 1e-4), which are those of no speculation.

    .venv/bin/python -m pytest -q tests/models/test_hybrid_verify_graphs_gpu.py"""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from worker.test_hybrid_verify_graphs_cpu import (  # noqa: E402
    MAX_TOKENS,
    SPEC,
    K,
    _prompts,
    _scripted_drafts,
    hybrid,  # noqa: F401 (fixture)
)

from shoal import LLM, SamplingParams  # noqa: E402

ENGINE = dict(dtype="float32", max_num_batched_tokens=64, num_gpu_blocks_override=32,
              max_model_len=128, max_num_seqs=4)


def _run(path, enforce_eager: bool, **kw):
    """(each request's output, (shape, requests, drafts?, replays?) of every graph replay)."""
    llm = LLM(model=str(path), enforce_eager=enforce_eager, **ENGINE, **kw)
    runner = llm.llm_engine.core.runner
    runs: list = []
    if runner.graphs is not None:
        real_run = runner.graphs.run

        def run(shape, inp, fill, **kw):
            runs.append((shape, len(inp.items), inp.has_drafts,
                         any(it.replay for it in inp.items)))
            return real_run(shape, inp, fill, **kw)
        runner.graphs.run = run
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
              for n in MAX_TOKENS]
    outs = [o.outputs[0] for o in llm.generate(
        [{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)]
    verify_qs = runner.graphs.verify_qs if runner.graphs is not None else []
    llm.shutdown()
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return outs, runs, verify_qs


def test_verify_graphs_give_the_eager_tokens(hybrid, monkeypatch):  # noqa: F811
    plain, _, _ = _run(hybrid, enforce_eager=True)
    _scripted_drafts(monkeypatch, {tuple(p): o.token_ids for p, o in zip(_prompts(), plain)})
    eager, none, _ = _run(hybrid, enforce_eager=True, speculative_config=SPEC)
    graphed, runs, verify_qs = _run(hybrid, enforce_eager=False, speculative_config=SPEC)
    assert none == [] and verify_qs == [2, K + 1]
    assert [o.token_ids for o in eager] == [o.token_ids for o in plain]
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
    for g, e in zip(graphed, eager):
        for a, b in zip(g.logprobs, e.logprobs):
            (tok,) = a
            assert abs(a[tok].logprob - b[tok].logprob) < 1e-4
    verifies = [(s, n) for s, n, drafts, _ in runs if drafts]
    assert any(s.rows > n for s, n in verifies)  # 3 requests padded to 4 rows
    assert {s.q for s, _ in verifies} == {2, K + 1}
    assert any(s.q == 2 and not d and r for s, _, d, r in runs)  # a decode folding a replay
    assert any(s.q == 1 for s, *_ in runs)  # plain decodes: decode graphs
