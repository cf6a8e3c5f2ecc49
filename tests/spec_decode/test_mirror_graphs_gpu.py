"""An EAGLE-3 head's mirror pass and draft 1 through real CUDA graphs (mirror_graphs.py;
skipped without a GPU): a tiny engine captures them at start-up with the draft graphs (graphs
on, the Triton backend). Unforced, the output is the plain engine's and every proposal the
EAGLE-3 formula; with every draft accepted, then none (forced), the output and every
proposal are what the same engine gives with enforce_eager."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from engine_helpers import random_prompts, tiny_llm  # noqa: E402
from spec_decode.proposal_log import record_proposals  # noqa: E402
from spec_decode.test_eagle3 import ckpt  # noqa: E402, F401 (the fixture)

from shoal import SamplingParams  # noqa: E402
from shoal.spec_decode.mirror_backlog import MAX_ROWS  # noqa: E402

K = 3
ENGINE = dict(attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=64)


def _mirror_runs(llm) -> list[tuple[int, int]]:
    """(padded rows, tokens a row) of each replay of the drafter's mirror graphs."""
    mirror = llm.llm_engine.core.runner.drafter.mirror_graphs
    assert mirror is not None and mirror.table.graphs and mirror.qs == [1, K + 1]
    runs: list[tuple[int, int]] = []
    inner = mirror.run

    def run(shape, *args):
        runs.append((shape.rows, shape.q))
        return inner(shape, *args)
    mirror.run = run
    return runs


def test_eagle3_mirror_replays_cuda_graphs(ckpt) -> None:  # noqa: F811
    target, folder, ref = ckpt
    spec = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": K}
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = random_prompts(3, seed=17, lo=2, hi=30)
    want = [o.outputs[0].token_ids for o in tiny_llm(target, **ENGINE).generate(
        prompts, sp, use_tqdm=False)]
    llm = tiny_llm(target, speculative_config=spec, **ENGINE)
    runs, log = _mirror_runs(llm), record_proposals(llm)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)] == want
    assert any(rows == 4 for rows, _ in runs)  # 3 requests, padded
    assert len(log) > 10
    for seq, drafts in log:
        assert drafts == ref.drafts(seq, len(drafts)), seq


def test_forced_mirrors_replay_as_the_eager_engine_runs_them(ckpt) -> None:  # noqa: F811
    target, folder, _ = ckpt
    spec = {"method": "eagle3", "model": str(folder), "num_speculative_tokens": K,
            "forced_acceptance_rate": 1.0}
    sp = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (16, 9, 9)]
    prompts = random_prompts(4, seed=18, lo=2, hi=30)
    outs, logs = [], []
    for eager in (True, False):
        llm = tiny_llm(target, speculative_config=spec, enforce_eager=eager, **ENGINE)
        runs = [] if eager else _mirror_runs(llm)
        log = record_proposals(llm)
        got = llm.generate(prompts[:3], sp, use_tqdm=False)
        llm.llm_engine.core.runner.drafter.forced_acceptance.rate = 0.0
        got += llm.generate(prompts[3:], sp[1], use_tqdm=False)
        outs.append([o.outputs[0].token_ids for o in got])
        logs.append(log)
    assert outs[0] == outs[1] and logs[0] == logs[1] and len(logs[1]) > 10
    # (the request alone backs off: catch-ups of its kept rows replay their own graphs)
    assert {1, K + 1} <= {q for _, q in runs} <= {1, K + 1, MAX_ROWS + K + 1}
    assert (4, K + 1) in runs
