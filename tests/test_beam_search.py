"""Beam search: the state machine on hand-made logprobs (EOS, length penalty, widths), and
`LLM.beam_search` on the tiny random model (width 1 is greedy; a wider beam never ends
below greedy here; every beam's cumulative logprob is the sum of its tokens' logprobs)."""

from __future__ import annotations

import math

import pytest
from engine_helpers import tiny_llm

from shoal.beam_search import BeamSearch, beam_score
from shoal.outputs import Logprob
from shoal.sampling_params import BeamSearchParams, SamplingParams

EOS = 2


def pos(**lps: float) -> dict[int, Logprob]:
    """{"t5": -0.1} -> {5: Logprob(-0.1)}"""
    return {int(k[1:]): Logprob(v) for k, v in lps.items()}


def test_keeps_the_best_width_candidates_across_beams() -> None:
    s = BeamSearch([7], BeamSearchParams(beam_width=2, max_tokens=2), [EOS])
    s.advance([pos(t10=math.log(0.5), t11=math.log(0.3), t12=math.log(0.2))])
    assert s.pending() == [[7, 10], [7, 11]]
    # The second beam's continuation beats both of the first's.
    s.advance([pos(t20=math.log(0.4), t21=math.log(0.4)), pos(t30=math.log(0.9))])
    assert s.done
    best = s.best(None)
    assert [b.tokens for b in best] == [[7, 11, 30], [7, 10, 20]]
    assert best[0].cum_logprob == pytest.approx(math.log(0.3 * 0.9))
    assert [b.finish_reason for b in best] == ["length", "length"]


def test_eos_completes_a_beam_and_the_search_continues_without_it() -> None:
    params = BeamSearchParams(beam_width=1, max_tokens=3)
    s = BeamSearch([7], params, [EOS])
    s.advance([pos(t2=math.log(0.6), t9=math.log(0.4))])
    assert s.pending() == [[7, 9]]  # the EOS candidate is completed, not live
    s.advance([pos(t9=math.log(0.1), t2=math.log(0.05))])
    s.advance([pos(t9=math.log(0.1))])
    best = s.best(lambda ids, skip: ",".join(map(str, ids)))
    assert len(best) == 1
    # EOS at once scores log 0.6 over length max(0, 1) = 1; the long beam far less.
    assert best[0].tokens == [7] and best[0].finish_reason == "stop"
    assert best[0].stop_reason == EOS and best[0].text == ""


def test_include_stop_str_keeps_the_eos_and_ignore_eos_continues() -> None:
    s = BeamSearch([7], BeamSearchParams(beam_width=1, max_tokens=1,
                                         include_stop_str_in_output=True), [EOS])
    s.advance([pos(t2=-0.1, t5=-3.0)])
    best = s.best(lambda ids, skip: ",".join(map(str, ids)))
    assert best[0].tokens == [7, 2] and best[0].text == ""  # the EOS is not in the text
    s = BeamSearch([7], BeamSearchParams(beam_width=1, max_tokens=1, ignore_eos=True), [EOS])
    s.advance([pos(t2=-0.1, t5=-3.0)])
    assert s.best(None)[0].tokens == [7, 2] and s.best(None)[0].finish_reason == "length"


def test_length_penalty_prefers_longer_beams_when_large() -> None:
    # cum -2 over 1 token vs -3 over 4 tokens.
    assert beam_score([1, 5], -2.0, [EOS], 1.0) < beam_score([5, 5, 5, 5], -3.0, [EOS], 1.0)
    assert beam_score([5], -2.0, [EOS], 0.0) > beam_score([5, 5, 5, 5], -3.0, [EOS], 0.0)
    assert beam_score([5, EOS], -2.0, [EOS], 1.0) == -2.0  # EOS not counted


@pytest.mark.parametrize("kwargs,field", [
    (dict(beam_width=0, max_tokens=1), "beam_width"),
    (dict(beam_width=1, max_tokens=0), "max_tokens"),
    (dict(beam_width=1, max_tokens=1, temperature=-1.0), "temperature"),
    (dict(beam_width=1, max_tokens=1, length_penalty="x"), "length_penalty"),
    (dict(beam_width=1, max_tokens=1, ignore_eos=1), "ignore_eos"),
])
def test_params_validation_names_the_field(kwargs, field) -> None:
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**kwargs)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return tiny_llm(tiny_llama_dir, enable_prefix_caching=True)


PROMPTS = [{"prompt_token_ids": [5, 77, 300, 12]}, {"prompt_token_ids": [9, 9, 41]}]


def test_width_one_is_greedy(llm) -> None:
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6,
                                                  ignore_eos=True, logprobs=0), use_tqdm=False)
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=6,
                                                      ignore_eos=True))
    for g, b in zip(greedy, beams):
        assert len(b.sequences) == 1
        seq = b.sequences[0]
        assert seq.tokens == list(g.prompt_token_ids) + list(g.outputs[0].token_ids)
        assert seq.cum_logprob == pytest.approx(g.outputs[0].cumulative_logprob, abs=1e-4)


def test_wider_beams_score_at_least_greedy_and_add_up(llm) -> None:
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=5,
                                                  ignore_eos=True, logprobs=0), use_tqdm=False)
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=5,
                                                      ignore_eos=True))
    for g, b in zip(greedy, beams):
        seqs = b.sequences
        assert len(seqs) == 4 and len({tuple(s.tokens) for s in seqs}) == 4
        assert seqs[0].cum_logprob >= g.outputs[0].cumulative_logprob - 1e-5
        assert [s.cum_logprob for s in seqs] == sorted((s.cum_logprob for s in seqs),
                                                       reverse=True)
    # Each beam's score is its tokens' logprobs under the model (scored as a prompt).
    seq = beams[0].sequences[1]
    n = len(PROMPTS[0]["prompt_token_ids"])
    scored = llm.generate([{"prompt_token_ids": seq.tokens}],
                          SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    total = sum(scored.prompt_logprobs[i][t].logprob for i, t in enumerate(seq.tokens)
                if i >= n)
    assert seq.cum_logprob == pytest.approx(total, abs=1e-4)
    assert len(seq.logprobs) == 5


def test_offline_refusals_name_the_field(llm) -> None:
    with pytest.raises(ValueError, match="beam_width"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="max_tokens"):
        llm.beam_search(PROMPTS, BeamSearchParams(beam_width=2, max_tokens=300))
    with pytest.raises(ValueError, match="params"):
        llm.beam_search(PROMPTS, SamplingParams())


def test_smollm2_text_prompts(smollm_llm) -> None:
    prompt = "The capital of France is"
    greedy = smollm_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4,
                                                          ignore_eos=True, logprobs=0),
                                 use_tqdm=False)[0].outputs[0]
    (out,) = smollm_llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=4,
                                                               ignore_eos=True))
    tok = smollm_llm.get_tokenizer()
    n = len(tok.encode(prompt))
    assert len(out.sequences) == 3
    for seq in out.sequences:
        assert seq.text == tok.decode(seq.tokens[n:], skip_special_tokens=True)
    assert out.sequences[0].cum_logprob >= greedy.cumulative_logprob - 1e-4
    assert "Paris" in out.sequences[0].text
