"""The rejection sampler on its own: the token it emits at a position is distributed as the
plain sampler's, whatever the draft, for every sampling setting."""

from __future__ import annotations

import pytest
import torch
from spec_decode.chi_square import chi_square_gof_p

from shoal.sample.rejection_sampler import rejection_sample
from shoal.sample.sampler import Sampler, process_logits, random_probs
from shoal.sample.sampling_metadata import SamplingMetadata, make_generator
from shoal.sampling_params import SamplingParams

V = 12
N = 20000  # rows, all the same position: one draw each


def _md(sp: SamplingParams, n: int, outputs: list[int] | None = None,
        generators: dict | None = None) -> SamplingMetadata:
    return SamplingMetadata.build([sp] * n, [list(outputs or [])] * n, [[1, 2, 3]] * n,
                                  generators or {}, frozenset({0}), V, "cpu")


def _target_probs(logits: torch.Tensor, sp: SamplingParams) -> list[float]:
    md = _md(sp, 1)
    processed = process_logits(logits[:1].clone(), md)
    return random_probs(processed, md)[0].tolist()


SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=5, top_p=0.85),
    SamplingParams(temperature=0.8, min_p=0.1, logit_bias={3: 1.5}),
]


@pytest.mark.parametrize("sp", SETTINGS, ids=["t1", "t0.6-topk-topp", "minp-bias"])
@pytest.mark.parametrize("draft", [0, 4, 9])
def test_emitted_token_has_the_target_distribution(sp: SamplingParams, draft: int) -> None:
    torch.manual_seed(1)
    logits = (torch.randn(V) * 1.5).repeat(N, 1)
    probs = _target_probs(logits, sp)
    torch.manual_seed(1234)  # the draws: fixed, so the test is deterministic
    out = rejection_sample(logits, _md(sp, N), [draft] * N)
    tokens = out.token_ids.tolist()
    assert chi_square_gof_p(tokens, probs) > 0.01
    accepted = out.accepted.float().mean().item()
    assert abs(accepted - probs[draft]) < 0.02  # accept with probability p(draft)
    assert all(t == draft for t, a in zip(tokens, out.accepted.tolist()) if a)


def test_a_biased_rule_fails_the_same_test() -> None:
    """The test has power: resampling from p itself (not p without the draft) after a
    rejection over-weights the draft, and the chi-square sees it."""
    torch.manual_seed(1)
    sp = SETTINGS[1]
    logits = (torch.randn(V) * 1.5).repeat(N, 1)
    probs = _target_probs(logits, sp)
    draft = max(range(V), key=lambda t: probs[t])
    out = rejection_sample(logits, _md(sp, N), [draft] * N)
    plain = Sampler()(logits, _md(sp, N)).sampled_token_ids
    biased = torch.where(out.accepted, out.token_ids, plain).tolist()
    assert chi_square_gof_p(biased, probs) < 1e-6


def test_penalties_see_the_drafts_before_a_row() -> None:
    """Row 1 of a request verifies its second draft with the first one counted as an
    output: the penalty then applies to it, exactly as after accepting it."""
    sp = SamplingParams(temperature=0.7, presence_penalty=1.5, repetition_penalty=1.4)
    torch.manual_seed(2)
    logits = (torch.randn(V) * 1.5).repeat(N, 1)
    probs = _target_probs(logits[:1].clone(), sp)
    md = _md(sp, 1, outputs=[5])
    with_5 = random_probs(process_logits(logits[:1].clone(), md), md)[0].tolist()
    assert with_5[5] < probs[5]
    out = rejection_sample(logits, _md(sp, N, outputs=[5]), [5] * N)
    assert chi_square_gof_p(out.token_ids.tolist(), with_5) > 0.01


def test_outside_top_k_never_accepted_and_greedy_accepts_the_argmax() -> None:
    torch.manual_seed(3)
    logits = torch.randn(4, V)
    order = logits[0].argsort(descending=True).tolist()
    sp = SamplingParams(temperature=0.5, top_k=2)
    out = rejection_sample(logits[:1].repeat(500, 1), _md(sp, 500), [order[5]] * 500)
    assert not out.accepted.any() and set(out.token_ids.tolist()) <= set(order[:2])
    greedy = SamplingParams(temperature=0)
    argmax = logits.argmax(-1).tolist()
    drafts = [argmax[0], (argmax[1] + 1) % V, argmax[2], -1]
    out = rejection_sample(logits, _md(greedy, 4), drafts)
    assert out.accepted.tolist() == [True, False, True, False]
    assert out.token_ids.tolist() == argmax


def test_seeded_rows_repeat_and_mixed_greedy_rows_stay_greedy() -> None:
    torch.manual_seed(4)
    logits = torch.randn(3, V)
    params = [SamplingParams(temperature=0.9, seed=7), SamplingParams(temperature=0),
              SamplingParams(temperature=0.9, seed=7)]

    def run() -> list[int]:
        gens = {0: make_generator(7, "cpu"), 2: make_generator(7, "cpu")}
        md = SamplingMetadata.build(params, [[], [], []], [[1]] * 3, gens, frozenset(), V,
                                    "cpu")
        return rejection_sample(logits, md, [1, 2, 3]).token_ids.tolist()

    first = run()
    assert run() == first
    assert first[1] == logits[1].argmax().item()


def test_logprobs_are_of_the_emitted_tokens() -> None:
    torch.manual_seed(5)
    logits = torch.randn(3, V)
    sp = SamplingParams(temperature=0.8, logprobs=2)
    out = rejection_sample(logits, _md(sp, 3), [1, 2, -1])
    assert out.logprobs is not None
    ref = torch.log_softmax(logits, -1).gather(1, out.token_ids[:, None])[:, 0]
    assert torch.allclose(out.logprobs.logprobs[:, 0], ref)


def test_verify_rows_count_earlier_drafts_as_outputs() -> None:
    """Greedy with a repetition penalty: token 5 leads until it has been output once. Two
    drafts of 5: the first is the argmax and accepted; at the second row the first draft
    counts as an output, the penalty makes 6 the argmax, and the draft is rejected."""
    from shoal.sample.verify import verify
    from shoal.worker.request_state import RequestState

    logits = torch.full((3, V), -1.0)
    logits[:, 5], logits[:, 6] = 2.0, 1.8
    st = RequestState([1, 2], SamplingParams(temperature=0, repetition_penalty=1.5),
                      frozenset({0}), None, [3])
    rows, out, finite = verify(logits, [st], [[5, 5]], V, torch.device("cpu"), None)
    assert rows.counts == [3] and finite.all()
    assert out.accepted.tolist() == [True, False, False]
    assert out.token_ids.tolist()[:2] == [5, 6]
