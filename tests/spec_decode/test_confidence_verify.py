"""Confidence-scheduled verification (speculative_config confidence_threshold): the rule that
picks how many drafts a request verifies from the drafter's probabilities, its acceptance
estimate and the batch size, and an EAGLE engine using it (lossless; fewer drafts verified as
the threshold rises; proposed >= verified >= accepted by position)."""

from __future__ import annotations

import pytest
from engine_helpers import blocks_all_free, random_prompts, tiny_llm
from spec_decode.test_eagle import build_checkpoints

from shoal import SamplingParams
from shoal.config.speculative import SpeculativeConfig
from shoal.core.request import Request
from shoal.engine import draft_budget
from shoal.engine.draft_budget import DraftBudget, confidence_threshold, confident_num_drafts
from shoal.sampling_params import SamplingParams as SP

K = 3


def test_rule_picks_the_longest_confident_prefix() -> None:
    probs = [0.9, 0.8, 0.5]  # cumulative 0.9, 0.72, 0.36
    assert confident_num_drafts(probs, 3, 1.0, 0.0) == 3
    assert confident_num_drafts(probs, 3, 1.0, 0.36) == 3
    assert confident_num_drafts(probs, 3, 1.0, 0.5) == 2
    assert confident_num_drafts(probs, 3, 1.0, 0.8) == 1
    assert confident_num_drafts(probs, 3, 1.0, 0.95) == 0
    assert confident_num_drafts(probs, 2, 1.0, 0.0) == 2  # never past k
    assert confident_num_drafts(probs, 3, 0.5, 0.4) == 1  # the estimate scales it: 0.45, 0.36
    assert confident_num_drafts([], 2, 1.0, 0.9) == 2  # unknown probabilities: sure
    assert confident_num_drafts([0.2, 1.0], 2, 1.0, 0.3) == 0  # a prefix: no skipping


def test_threshold_rises_with_the_batch() -> None:
    full = draft_budget.CONFIDENCE_FULL_BATCH
    values = [confidence_threshold(0.8, n) for n in range(1, 2 * full)]
    assert values == sorted(values)
    assert confidence_threshold(0.8, full) == confidence_threshold(0.8, 4 * full) == 0.8
    assert confidence_threshold(0.8, full // 2) == pytest.approx(0.4)


def _req(probs: list[float]) -> Request:
    req = Request("r", [5, 6, 7], SP(max_tokens=50), frozenset(), 50, arrival_time=0.0)
    req.spec_token_ids, req.spec_probs = [11, 12, 13], probs
    return req


def test_budget_applies_the_rule_and_counts_per_position() -> None:
    full = draft_budget.CONFIDENCE_FULL_BATCH
    off = DraftBudget(K, 256, adaptive=False)
    assert off.num_drafts(_req([0.1, 0.1, 0.1]), 10, True, full) == K  # off: all of them
    on = DraftBudget(K, 256, adaptive=False, confidence=0.5)
    assert on.num_drafts(_req([0.9, 0.5, 0.9]), 10, True, full) == 1  # 0.9, 0.45, 0.405
    assert on.num_drafts(_req([0.9, 0.5, 0.9]), 10, True, full // 2) == K  # threshold 0.25
    assert on.num_drafts(_req([0.3, 0.9, 0.9]), 10, True, full) == 0  # a plain decode
    req = _req([0.9, 0.9, 0.9])
    assert on.num_drafts(req, 10, True, full) == K  # 0.9, 0.81, 0.729
    on.settle(req, 2, 1)  # (the scheduler may verify fewer: blocks)
    stats = on.take_stats()
    assert stats["spec_num_proposed_tokens_per_pos"] == [4, 4, 4]
    assert stats["spec_num_verified_tokens_per_pos"] == [1, 1, 0]
    assert stats["spec_num_accepted_tokens_per_pos"] == [1, 0, 0]
    # Adaptive: the estimate (the prior 4/5, decayed once: 3.4/4.4) times the probabilities.
    adaptive = DraftBudget(K, 256, confidence=0.5)
    assert adaptive.num_drafts(_req([0.9, 0.7, 0.9]), 10, True, full) == 1  # .695, .487


def test_config_key() -> None:
    base = {"method": "ngram", "num_speculative_tokens": 2}
    assert SpeculativeConfig.from_user(base).confidence_threshold is None
    assert SpeculativeConfig.from_user({**base, "confidence_threshold": 0.3}
                                       ).confidence_threshold == 0.3
    for bad in (1.0, -0.1, "x", True):
        with pytest.raises(ValueError, match="confidence_threshold"):
            SpeculativeConfig.from_user({**base, "confidence_threshold": bad})


class PosCounter:
    """Sums of the engine's per-position proposed / verified / accepted counts."""

    def __init__(self, llm):
        self.pos = {"proposed": [0] * K, "verified": [0] * K, "accepted": [0] * K}
        sched = llm.llm_engine.core.scheduler
        inner = sched.stats

        def stats():
            s = inner()
            for name, counts in self.pos.items():
                for i, v in enumerate(getattr(s, f"spec_num_{name}_tokens_per_pos") or []):
                    counts[i] += v
            return s
        sched.stats = stats


@pytest.fixture(scope="module")
def ckpts(tiny_llama_dir, tmp_path_factory):
    return build_checkpoints(tiny_llama_dir, tmp_path_factory.mktemp("eagle"))


def test_eagle_with_confidence_is_lossless_and_verifies_fewer(ckpts, monkeypatch) -> None:
    monkeypatch.setattr(draft_budget, "CONFIDENCE_FULL_BATCH", 1)  # the setting as given
    target, folder, _ = ckpts["bigram"]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = random_prompts(3, seed=8, lo=2, hi=30)
    want = [o.outputs[0].token_ids for o in tiny_llm(target).generate(prompts, sp,
                                                                       use_tqdm=False)]
    verified = {}
    for c in (0.0, 0.999):
        spec = {"method": "eagle", "model": str(folder), "num_speculative_tokens": K,
                "confidence_threshold": c, "adaptive_budget": False}
        llm = tiny_llm(target, speculative_config=spec)
        counter = PosCounter(llm)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == want, c
        assert blocks_all_free(llm)
        pos = counter.pos
        assert sum(pos["proposed"]) > 0
        for i in range(K):
            assert pos["proposed"][i] >= pos["verified"][i] >= pos["accepted"][i], pos
        verified[c] = sum(pos["verified"])
        if c == 0.0:  # all verified (no backoff: drafts are accepted), up to max_tokens
            assert pos["verified"][0] == pos["proposed"][0] and sum(pos["accepted"]) > 0, pos
    assert verified[0.999] < verified[0.0], verified


def test_eagle_draft_probabilities_are_sent(ckpts) -> None:
    target, folder, _ = ckpts["random"]
    spec = {"method": "eagle", "model": str(folder), "num_speculative_tokens": K,
            "confidence_threshold": 0.2}
    llm = tiny_llm(target, speculative_config=spec)
    sched = llm.llm_engine.core.scheduler
    seen: list[list[float]] = []
    inner = sched.update

    def update(so, result):
        for serial, probs in result.draft_probs.items():
            assert len(probs) == len(result.draft_token_ids[serial])
            seen.append(probs)
        return inner(so, result)
    sched.update = update
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(random_prompts(2, seed=3, lo=2, hi=20), sp, use_tqdm=False)
    assert seen and all(0.0 < p <= 1.0 for probs in seen for p in probs)
    assert len({p for probs in seen for p in probs}) > 1


def _record_probs(llm) -> list[list[float]]:
    sched, seen = llm.llm_engine.core.scheduler, []
    inner = sched.update

    def update(so, result):
        seen.extend(result.draft_probs[s] for s in sorted(result.draft_probs))
        return inner(so, result)
    sched.update = update
    return seen


def test_graph_replays_carry_the_probabilities(ckpts) -> None:
    """Drafts 2..k through the (emulated) draft graphs carry the eager steps' probabilities."""
    pytest.importorskip("triton")
    from spec_decode.test_draft_graphs_cpu import MAX_BLOCKS, EagerDraftGraphs

    target, folder, _ = ckpts["bigram"]
    spec = {"method": "eagle", "model": str(folder), "num_speculative_tokens": K,
            "confidence_threshold": 0.1}
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = random_prompts(3, seed=9, lo=2, hi=20)
    runs = []
    for graphs in (False, True):
        # The eager steps on the torch backend: the Triton kernels' interpreter would double
        # the test's time, and the graphs must carry the same probabilities all the same.
        llm = tiny_llm(target, attention_backend="triton" if graphs else "torch",
                       max_num_seqs=4, speculative_config=spec)
        if graphs:
            llm.llm_engine.core.runner.drafter.capture_graphs(None, MAX_BLOCKS, EagerDraftGraphs)
        seen = _record_probs(llm)
        runs.append(([o.outputs[0].token_ids for o in llm.generate(prompts, sp,
                                                                      use_tqdm=False)], seen))
    assert runs[0][0] == runs[1][0] and llm.llm_engine.core.runner.drafter.graphs.runs
    assert len(runs[0][1]) == len(runs[1][1]) > 3
    for eager, graphed in zip(runs[0][1], runs[1][1]):
        assert graphed == pytest.approx(eager, rel=1e-4, abs=1e-6)
