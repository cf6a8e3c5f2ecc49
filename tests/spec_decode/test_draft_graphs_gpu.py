"""Drafting through real CUDA graphs (skipped without a GPU): tiny MTP, EAGLE and draft-model
engines capture their draft steps at start-up (graphs on, the Triton backend); the drafts
replay them for padded batches, every proposal is the drafter's formula and what the same
engine proposes with enforce_eager, and the output is the plain engine's."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from engine_helpers import random_prompts, tiny_llm  # noqa: E402
from oracle import hf_greedy  # noqa: E402
from spec_decode.proposal_log import record_proposals  # noqa: E402
from spec_decode.test_draft_model import _draft  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from shoal import SamplingParams  # noqa: E402

K = 3
ENGINE = dict(attention_backend="triton", max_num_seqs=4, max_num_batched_tokens=64)


def _ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _count_runs(drafter) -> list[int]:
    """The rows of each run through the drafter's graphs."""
    graphs = drafter.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4] and graphs.table.graphs
    runs: list[int] = []
    inner = graphs.run

    def run(ids, hidden, positions, tables, steps):
        runs.append(len(positions))
        return inner(ids, hidden, positions, tables, steps)
    graphs.run = run
    return runs


def _same_where_both(a: list[tuple[list[int], list[int]]],
                     b: list[tuple[list[int], list[int]]]) -> int:
    """Asserts the proposals of the sequences both logs hold agree as far as both go (a
    sequence may recur with another draft limit: the batch's run, then a request alone);
    returns how many."""
    first = {tuple(s): d for s, d in a}
    common = [(s, d) for s, d in b if tuple(s) in first]
    for s, d in common:
        n = min(len(d), len(first[tuple(s)]))
        assert first[tuple(s)][:n] == d[:n], s
    return len(common)


@pytest.mark.parametrize("method,name", [("mtp", "bigram"), ("mtp", "random"),
                                         ("eagle", "bigram"), ("eagle", "random")])
def test_hidden_state_drafts_replay_cuda_graphs(drafter_checkpoint, method, name):
    target, ref, spec = drafter_checkpoint(method, name, K)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = random_prompts(3, seed=9, lo=2, hi=20)
    want = _ids(tiny_llm(target, **ENGINE).generate(prompts, sp, use_tqdm=False))
    logs = []
    for eager in (False, True):
        llm = tiny_llm(target, speculative_config=spec, enforce_eager=eager, **ENGINE)
        drafter = llm.llm_engine.core.runner.drafter
        assert (drafter.graphs is None) == eager
        runs = None if eager else _count_runs(drafter)
        log = record_proposals(llm)
        assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == want
        assert _ids(llm.generate(prompts[1], sp, use_tqdm=False)) == [want[1]]
        if runs is not None:
            assert 3 in runs and 1 in runs  # 3 rows padded to 4, one alone
            # every proposal of 2+ drafts came out of a graph run (a batch runs to its
            # deepest draft limit; a request's drafts are then cut to its own)
            assert sum(runs) >= sum(len(d) >= 2 for _, d in log) > 5
        for seq, drafts in log:
            assert drafts == ref.drafts(seq, len(drafts)), seq
        logs.append(log)
    assert _same_where_both(*logs) > 5


def test_draft_model_replays_cuda_graphs(tiny_llama_dir, tmp_path):
    draft = _draft(tiny_llama_dir, tmp_path, 0.03)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = random_prompts(3, seed=2, lo=2, hi=20)
    want = _ids(tiny_llm(tiny_llama_dir, **ENGINE).generate(prompts, sp, use_tqdm=False))
    hf = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    logs = []
    for eager in (False, True):
        llm = tiny_llm(tiny_llama_dir, speculative_config=spec, enforce_eager=eager, **ENGINE)
        drafter = llm.llm_engine.core.runner.drafter
        assert (drafter.graphs is None) == eager
        runs = None if eager else _count_runs(drafter)
        log: list[tuple[list[int], list[int]]] = []
        inner = drafter.propose_batch

        def recording(seqs, tables, depth=None, inner=inner, log=log):
            drafts = inner(seqs, tables, depth)
            log.extend((list(s), d) for s, d in zip(seqs, drafts))
            return drafts
        drafter.propose_batch = recording
        assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == want
        assert _ids(llm.generate(prompts[0], sp, use_tqdm=False)) == [want[0]]
        if runs is not None:
            assert 3 in runs and 1 in runs and sum(runs) == len(log) > 5
        for seq, drafts in log:
            assert drafts == hf_greedy(hf, seq, len(drafts))[0], seq
        logs.append(log)
    assert _same_where_both(*logs) > 5
