"""Speculative decoding under tensor parallelism: two gloo ranks on the CPU (the mp executor)
against one rank, for ngram, a draft model, EAGLE-1, EAGLE-3 and MTP (DeepSeek-V3).

For each method: greedy tokens are the plain engine's (lossless) and the one-rank speculative
engine's, and the acceptance counters (drafts, draft tokens, accepted) are the one-rank
run's (EAGLE-1 with confidence-scheduled verification), which they are only if rank 0
proposes what one rank does. Drafters with layers are sharded like the target (their KV
heads split over the ranks). The hidden-state heads' proposals on rank 0 are also checked
against the plain-torch formula, with unseeded sampling after this process's random
generator has moved on: the worker rank's own sampling then differs from rank 0's, and only
rank 0's tokens taken by every rank (ModelRunner.sample) keep the sharded head's inputs, and
so its drafts, right (without them the ranks' collectives no longer match and gloo aborts)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from typing import Any

import pytest
import torch
from engine_helpers import random_prompts, tiny_llm
from oracle import write_tiny_checkpoint
from safetensors.torch import load_file, save_file
from spec_decode.test_eagle3 import LAYERS as EAGLE3_LAYERS
from spec_decode.test_eagle3 import Reference as Eagle3Reference
from spec_decode.test_eagle3 import head_weights, write_head
from spec_decode.test_spec_engine import SpecCounter

from shoal import SamplingParams

K = 3
PROMPTS = random_prompts(3, seed=11, lo=4, hi=24)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
UNSEEDED = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)


def _ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def draft_dir(eagle_ckpts, tmp_path_factory):
    """A draft model for the "bigram" target: its weights with a noisy output head, so some
    drafts are accepted and some are not."""
    target = eagle_ckpts["bigram"][0]
    folder = tmp_path_factory.mktemp("draft")
    shutil.copy(target / "config.json", folder / "config.json")
    w = load_file(target / "model.safetensors")
    gen = torch.Generator().manual_seed(2)
    w["lm_head.weight"] = w["lm_head.weight"] + 0.3 * w["lm_head.weight"].std() * torch.randn(
        w["lm_head.weight"].shape, generator=gen)
    save_file(w, folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def ngram_prompts(eagle_ckpts):
    """Prompts whose last token came earlier, followed there by what the "bigram" target
    (its next token a function of the current one) continues with: prompt lookup drafts
    are accepted. And PROMPTS[0] itself, whose lookups find nothing or are rejected."""
    chain, _ = _greedy_run(eagle_ckpts["bigram"][0], 1, None)
    built = [{"prompt_token_ids": p["prompt_token_ids"] + g[:6] + p["prompt_token_ids"][-1:]}
             for p, g in zip(PROMPTS[1:], chain[1:])]
    return PROMPTS[:1] + built


@pytest.fixture(scope="module")
def eagle3_ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3-tp")
    target = write_tiny_checkpoint(root / "target", "llama", seed=3,
                                   num_hidden_layers=EAGLE3_LAYERS)
    w = head_weights(seed=5)
    return target, write_head(root / "head", w), Eagle3Reference(target, w)


def _record_driver_proposals(llm) -> list[tuple[list[int], list[int]]]:
    """Every proposal rank 0's hidden-state drafter makes: (the sequence then, its drafts)."""
    drafter = llm.llm_engine.core.runner.driver.drafter
    log: list[tuple[list[int], list[int]]] = []
    inner = drafter.mirror_and_propose

    def recording(reqs, hidden, failed, propose=True):
        drafts = inner(reqs, hidden, failed, propose=propose)
        log.extend((r.state.all_token_ids(), drafts[r.serial]) for r in reqs
                   if r.serial in drafts)
        return drafts
    drafter.mirror_and_propose = recording
    return log


def _greedy_run(target, tp: int, spec: dict | None, check=None, prompts=PROMPTS):
    """Greedy tokens and (drafts, draft tokens, accepted) of prompts; check(llm) runs on the
    engine before it shuts down."""
    llm = tiny_llm(target, tensor_parallel_size=tp, speculative_config=spec)
    try:
        counter = SpecCounter(llm)
        tokens = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
        counts = (counter.drafts, counter.draft_tokens, counter.accepted)
        if check is not None:
            check(llm)
        return tokens, counts
    finally:
        llm.shutdown()


def _drafter_heads(llm) -> list[tuple[int, int | None]]:
    """(query heads, KV heads) of each of rank 0's drafter layers, whose KV cache is bound."""
    runner = llm.llm_engine.core.runner
    layers = getattr(runner, "driver", runner).drafter.kv_layers()
    assert all(layer.kv_cache is not None for layer in layers)
    return [(layer.num_heads, getattr(layer, "num_kv_heads", None)) for layer in layers]


def _proposals_follow_the_formula(ref) -> Callable[[Any], None]:
    """check(llm): unseeded sampling after this process's generator moved on; every drafts
    rank 0 proposes are the reference formula's for its sequence."""
    def check(llm) -> None:
        log = _record_driver_proposals(llm)
        torch.rand(1000)  # rank 0's generator is no longer the worker's
        llm.generate(PROMPTS, UNSEEDED, use_tqdm=False)
        assert len(log) >= len(PROMPTS)
        for seq, drafts in log:
            assert drafts == ref.drafts(seq, len(drafts)), seq
    return check


def _spec(method: str, request):
    """(target, speculative config, reference or None); the checkpoints of the method only."""
    if method == "mtp":
        target, ref = request.getfixturevalue("mtp_ckpts")["bigram"]
        return target, {"method": "mtp", "num_speculative_tokens": K}, ref
    if method == "eagle3":
        target, head, ref = request.getfixturevalue("eagle3_ckpt")
        return target, {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}, ref
    bigram, eagle_head, eagle_ref = request.getfixturevalue("eagle_ckpts")["bigram"]
    if method == "ngram":
        return bigram, {"method": "ngram", "num_speculative_tokens": K}, None
    if method == "draft_model":
        return bigram, {"method": "draft_model", "model": str(request.getfixturevalue(
            "draft_dir")), "num_speculative_tokens": K}, None
    # (with confidence-scheduled verification: rank 0's draft probabilities pick the drafts)
    return bigram, {"method": "eagle", "model": str(eagle_head), "num_speculative_tokens": K,
                    "confidence_threshold": 0.3}, eagle_ref


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle", "eagle3", "mtp"])
def test_two_ranks_speculate_as_one_rank_does(method, request):
    torch.set_num_threads(1)
    target, spec, ref = _spec(method, request)
    prompts = request.getfixturevalue("ngram_prompts") if method == "ngram" else PROMPTS
    heads: dict[int, list] = {}
    plain, _ = _greedy_run(target, 1, None, prompts=prompts)
    one, one_counts = _greedy_run(target, 1, spec, lambda llm: heads.update({1: _drafter_heads(
        llm)}), prompts)

    def check(llm) -> None:
        runner = llm.llm_engine.core.runner
        assert type(runner).__name__ == "MultiprocExecutor" and runner.world == 2
        heads[2] = _drafter_heads(llm)
        if ref is not None:
            _proposals_follow_the_formula(ref)(llm)
    two, two_counts = _greedy_run(target, 2, spec, check, prompts)
    assert one == plain and two == plain
    assert two_counts == one_counts
    drafts, draft_tokens, accepted = one_counts
    assert drafts > 0 and 0 <= accepted <= draft_tokens <= K * drafts
    if method != "eagle3":  # (its random head's drafts are rejected)
        assert accepted > 0
    # Sharded like the target: half the heads and KV heads on each rank, so half the KV (MLA
    # keeps its one latent "head" whole on every rank, as the target does).
    assert (heads[1] == []) == (method == "ngram")
    assert heads[2] == [(h // 2, max(1, kv // 2)) for h, kv in heads[1]]


