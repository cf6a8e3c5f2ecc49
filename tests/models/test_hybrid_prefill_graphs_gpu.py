"""Lone prompts of hybrid models (Qwen3.5 and Qwen3-Next's Gated DeltaNet, Kimi Linear's KDA)
through the padded prefill CUDA graphs on a GPU (skipped without one): the tiny fp32
checkpoints and prompts of tests/worker/test_hybrid_prefill_graphs_cpu.py (a chunk crossing a
block end, a prefix hit's tail, a short prompt, a 110-token prompt: one chunk here, a budget
of 128 tokens giving graphs of 16 to 128), with the engine capturing its own graphs
(fla-core's chunked kernels inside them where installed). Tokens are the enforce_eager
engine's, logprobs within 1e-4.

    .venv/bin/python -m pytest -q tests/models/test_hybrid_prefill_graphs_gpu.py"""

from __future__ import annotations

import gc

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from worker.test_hybrid_prefill_graphs_cpu import (  # noqa: E402
    _generate,
    _prompts,
    _same,
    hybrid,  # noqa: F401 (fixture)
)

from shoal import LLM  # noqa: E402


def _run(path, enforce_eager: bool):
    """(each prompt's output, (q, real tokens, context) of every prefill graph replay)."""
    llm = LLM(model=str(path), dtype="float32", max_num_batched_tokens=128,
              num_gpu_blocks_override=32, max_model_len=320, max_num_seqs=2,
              enforce_eager=enforce_eager)
    runner = llm.llm_engine.core.runner
    runs: list = []
    if runner.graphs is not None:
        real_run = runner.graphs.run

        def run(shape, inp, fill, **kw):
            if shape.q > 1:
                runs.append((shape.q, inp.num_tokens, inp.items[0].context_len))
            return real_run(shape, inp, fill, **kw)
        runner.graphs.run = run
    outs = _generate(llm, _prompts(runner.block_size))
    bs = runner.block_size
    llm.shutdown()
    del llm, runner
    gc.collect()
    torch.cuda.empty_cache()
    return outs, runs, bs


def test_prefill_graphs_give_the_eager_tokens(hybrid):  # noqa: F811
    eager, none, bs = _run(hybrid, enforce_eager=True)
    graphed, runs, _ = _run(hybrid, enforce_eager=False)
    assert none == []
    _same(graphed, eager)
    # every prompt's prefill replayed a graph (the prefix hit's from the saved block end)
    assert runs == [(128, bs + 20, 0), (32, 20, bs), (16, 11, 0), (128, 110, 0)]
