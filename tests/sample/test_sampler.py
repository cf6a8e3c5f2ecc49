"""Sampler and SamplingMetadata on random logits: exactness of the greedy path and the logit
processors, the support and distribution of the random path, seeded reproducibility, logprobs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from shoal.sample.sampler import (
    Sampler,
    apply_penalties,
    compute_logprobs_tensors,
)
from shoal.sample.sampling_metadata import SamplingMetadata, make_generator
from shoal.sampling_params import SamplingParams

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


def build(
    params: list[SamplingParams],
    vocab: int,
    device: str = "cpu",
    outputs: list[list[int]] | None = None,
    prompts: list[list[int]] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    eos: object = (),
) -> SamplingMetadata:
    return SamplingMetadata.build(
        params,
        outputs if outputs is not None else [[] for _ in params],
        prompts if prompts is not None else [[] for _ in params],
        generators or {},
        eos,
        vocab,
        device,
    )


def sample(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    return Sampler()(logits, md).sampled_token_ids


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


# -- metadata -------------------------------------------------------------------------------------


def test_build_all_greedy_builds_almost_nothing() -> None:
    md = build([SamplingParams(temperature=0.0, top_k=5, top_p=0.5)] * 3, vocab=50)
    assert md.all_greedy and not md.all_random
    assert torch.equal(md.temperature, torch.zeros(3))
    assert md.top_k is None and md.top_p is None and md.min_p is None
    assert md.no_penalties and md.prompt_token_ids is None
    assert md.banned_token_ids == {} and md.max_num_logprobs is None
    assert md.logit_bias == [None, None, None]


def test_build_mixed_batch() -> None:
    params = [
        SamplingParams(temperature=0.0, top_k=3),  # greedy: its filters are dropped
        SamplingParams(temperature=0.5, top_k=3, logprobs=2),
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1, logprobs=5),
        SamplingParams(temperature=1.0, top_k=500),  # larger than the vocab = disabled
    ]
    md = build(params, vocab=50)
    assert not md.all_greedy and not md.all_random
    assert md.temperature.dtype == torch.float32
    assert torch.allclose(md.temperature, torch.tensor([0.0, 0.5, 1.0, 1.0]))
    assert md.top_k.tolist() == [50, 3, 50, 50] and md.top_k.dtype == torch.int64
    assert torch.allclose(md.top_p, torch.tensor([1.0, 1.0, 0.9, 1.0]))
    assert torch.allclose(md.min_p, torch.tensor([0.0, 0.0, 0.1, 0.0]))
    assert md.max_num_logprobs == 5
    assert build([SamplingParams(top_k=50)], vocab=50).top_k is None
    assert build([SamplingParams(temperature=0.3)], vocab=50).all_random


def test_build_penalties_and_prompt_padding() -> None:
    params = [SamplingParams(repetition_penalty=1.2), SamplingParams(presence_penalty=0.5)]
    md = build(params, vocab=10, prompts=[[1, 2, 3], [4]], outputs=[[5], []])
    assert md.prompt_token_ids.tolist() == [[1, 2, 3], [4, 10, 10]]
    assert torch.allclose(md.repetition_penalties, torch.tensor([1.2, 1.0]))
    assert torch.allclose(md.presence_penalties, torch.tensor([0.0, 0.5]))
    assert md.frequency_penalties is None
    # Without a repetition penalty the prompt is not needed, so it is not packed.
    assert (
        build([SamplingParams(frequency_penalty=1.0)], 10, prompts=[[1]]).prompt_token_ids is None
    )


def test_build_min_tokens_bans() -> None:
    params = [
        SamplingParams(min_tokens=3, stop_token_ids=[7]),
        SamplingParams(min_tokens=3, stop_token_ids=[7], ignore_eos=True),
        SamplingParams(min_tokens=2),  # already reached
        SamplingParams(),
    ]
    outputs = [[1], [1], [1, 1], []]
    md = build(params, vocab=10, outputs=outputs, eos={2})
    assert md.banned_token_ids == {0: [2, 7], 1: [7]}
    # One eos list per row.
    md = build(params[:2], vocab=10, outputs=outputs[:2], eos=[[2], [3, 4]])
    assert md.banned_token_ids == {0: [2, 7], 1: [7]}
    md = build([SamplingParams(min_tokens=1)] * 2, vocab=10, eos=[[2], [3, 4]])
    assert md.banned_token_ids == {0: [2], 1: [3, 4]}


def test_empty_batch() -> None:
    md = build([], vocab=10)
    out = Sampler()(torch.empty(0, 10), md)
    assert out.sampled_token_ids.shape == (0,)


# -- greedy ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_is_argmax(device: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, 1000, device=device).to(dtype)
    before = logits.clone()
    out = sample(logits, build([SamplingParams(temperature=0.0)] * 16, 1000, device))
    assert out.dtype == torch.int64 and out.shape == (16,)
    assert torch.equal(out, logits.float().argmax(dim=-1))
    assert torch.equal(logits, before)  # the caller's logits are not modified


def test_greedy_ties_pick_lowest_id(device: str) -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0], [5.0, 5.0, 5.0, 5.0]], device=device)
    assert sample(logits, build([SamplingParams(temperature=0.0)] * 2, 4, device)).tolist() == [
        1,
        0,
    ]
    # top_k=1 and a tiny top_p agree with greedy on ties too.
    for p in (SamplingParams(top_k=1), SamplingParams(top_p=1e-6)):
        assert sample(logits, build([p] * 2, 4, device)).tolist() == [1, 0]


def test_float32_logits_are_not_modified_in_place(device: str) -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 20, device=device)
    before = logits.clone()
    params = [
        SamplingParams(temperature=0.5, top_k=3, top_p=0.8, min_p=0.1),
        SamplingParams(temperature=0.0, logit_bias={3: 10.0}, min_tokens=2),
        SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=1.0),
    ]
    md = build(params, 20, device, outputs=[[1], [2], [3, 3]], prompts=[[4]] * 3, eos={0})
    Sampler()(logits, md)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("seed", range(5))
def test_top_k_1_and_tiny_top_p_equal_greedy(device: str, seed: int) -> None:
    torch.manual_seed(seed)
    logits = torch.randn(32, 500, device=device) * 3
    expected = logits.argmax(dim=-1)
    for p in (
        SamplingParams(top_k=1),
        SamplingParams(top_p=1e-6),
        SamplingParams(temperature=2.0, top_k=1, top_p=0.9),
    ):
        assert torch.equal(sample(logits, build([p] * 32, 500, device)), expected), p


def test_mixed_batch_greedy_rows_stay_exact(device: str) -> None:
    torch.manual_seed(2)
    logits = torch.randn(8, 300, device=device)
    params = [
        SamplingParams(temperature=0.0) if i % 2 else SamplingParams(top_k=5) for i in range(8)
    ]
    out = sample(logits, build(params, 300, device))
    assert torch.equal(out[1::2], logits[1::2].argmax(dim=-1))
    top5 = logits[0::2].topk(5, dim=-1).indices
    assert (top5 == out[0::2, None]).any(dim=-1).all()


# -- random path: support and distribution --------------------------------------------------------


def repeated(row: list[float], n: int, device: str) -> torch.Tensor:
    return torch.tensor(row, device=device).log().expand(n, -1).contiguous()


def test_top_k_support_and_renormalization(device: str) -> None:
    torch.manual_seed(3)
    probs = torch.tensor([0.05, 0.3, 0.1, 0.2, 0.15, 0.2])
    n = 20000
    logits = repeated(probs.tolist(), n, device)
    out = sample(logits, build([SamplingParams(top_k=3)] * n, 6, device)).cpu()
    counts = torch.bincount(out, minlength=6).float()
    # Top 3 by probability are ids 1, 3, 5 (ties between 3 and 5 both lie inside the top 3).
    assert set(out.tolist()) == {1, 3, 5}
    kept = torch.tensor([0.0, 0.3, 0.0, 0.2, 0.0, 0.2])
    assert chi_square(counts, kept / kept.sum()) < 25.0


def test_top_p_support(device: str) -> None:
    torch.manual_seed(4)
    probs = [0.05, 0.5, 0.15, 0.3]
    n = 20000
    logits = repeated(probs, n, device)
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: the nucleus is {1, 3}.
    out = sample(logits, build([SamplingParams(top_p=0.7)] * n, 4, device)).cpu()
    assert set(out.tolist()) == {1, 3}
    counts = torch.bincount(out, minlength=4).float()
    assert chi_square(counts, torch.tensor([0.0, 0.5, 0.0, 0.3]) / 0.8) < 25.0


def test_min_p_support(device: str) -> None:
    torch.manual_seed(5)
    probs = [0.1, 0.4, 0.2, 0.3]
    n = 20000
    logits = repeated(probs, n, device)
    # Threshold 0.6 * 0.4 = 0.24 keeps ids 1 (0.4) and 3 (0.3).
    out = sample(logits, build([SamplingParams(min_p=0.6)] * n, 4, device)).cpu()
    assert set(out.tolist()) == {1, 3}
    counts = torch.bincount(out, minlength=4).float()
    assert chi_square(counts, torch.tensor([0.0, 0.4, 0.0, 0.3]) / 0.7) < 25.0
    # min_p=0 keeps everything.
    out = sample(logits, build([SamplingParams(min_p=0.0)] * n, 4, device)).cpu()
    assert set(out.tolist()) == {0, 1, 2, 3}


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_distribution_matches_softmax(device: str, temperature: float) -> None:
    torch.manual_seed(6)
    base = torch.tensor([1.0, -0.5, 0.3, 2.0, 0.0, -1.0])
    n = 40000
    logits = base.to(device).expand(n, -1).contiguous()
    out = sample(logits, build([SamplingParams(temperature=temperature)] * n, 6, device)).cpu()
    counts = torch.bincount(out, minlength=6).float()
    # df = 5: the 0.999 quantile is about 20.5; the bound is loose and the seed fixed.
    assert chi_square(counts, torch.softmax(base / temperature, dim=-1)) < 25.0
    if temperature != 1.0:
        # The statistic must notice a sampler that ignored the temperature.
        assert chi_square(counts, torch.softmax(base, dim=-1)) > 200.0


# -- seeded rows ----------------------------------------------------------------------------------


def run_steps(
    device: str,
    seed: int,
    row_logits: torch.Tensor,
    position: int,
    others: list[SamplingParams],
    steps: int = 6,
) -> list[int]:
    """Sample `steps` tokens for one seeded row placed at `position` among `others`."""
    gen = make_generator(seed, device)
    params = list(others)
    params.insert(position, SamplingParams(temperature=1.0, seed=seed))
    tokens = []
    for step in range(steps):
        torch.manual_seed(1000 + step * 7 + len(others))  # the default RNG differs per batch
        logits = torch.randn(len(params), row_logits.shape[-1], device=device)
        logits[position] = row_logits
        md = build(params, row_logits.shape[-1], device, generators={position: gen})
        tokens.append(int(sample(logits, md)[position]))
    return tokens


def test_seeded_row_is_reproducible_and_batch_independent(device: str) -> None:
    row = torch.zeros(1000, device=device)  # uniform: any dependence on the noise shows up
    alone = run_steps(device, 1234, row, 0, [])
    assert alone == run_steps(device, 1234, row, 0, [])
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=5, top_p=0.5, min_p=0.1),
        SamplingParams(temperature=0.7, seed=99),  # seeded, but without a generator here
        SamplingParams(repetition_penalty=1.3, logprobs=3),
    ]
    assert run_steps(device, 1234, row, 2, others) == alone
    assert run_steps(device, 1234, row, 4, others) == alone
    assert run_steps(device, 4321, row, 0, []) != alone


def test_seeded_rows_with_same_seed_in_one_batch_draw_independently(device: str) -> None:
    # Two requests with the same seed produce the same tokens: each has its own generator.
    row = torch.zeros(1000, device=device)
    gens = {0: make_generator(7, device), 1: make_generator(7, device)}
    md = build([SamplingParams(seed=7)] * 2, 1000, device, generators=gens)
    out = sample(torch.stack([row, row]), md)
    assert out[0] == out[1]
    # for_sample seeds make the n samples of one request differ.
    parent = SamplingParams(n=2, seed=7)
    children = [parent.for_sample(i) for i in range(2)]
    gens = {i: make_generator(c.seed, device) for i, c in enumerate(children)}
    md = build(children, 1000, device, generators=gens)
    out = sample(torch.stack([row, row]), md)
    assert out[0] != out[1]


# -- logit processors -----------------------------------------------------------------------------


def reference_penalties(
    logits: list[list[float]],
    prompts: list[list[int]],
    outputs: list[list[int]],
    presence: list[float],
    frequency: list[float],
    repetition: list[float],
) -> list[list[float]]:
    result = []
    for i, row in enumerate(logits):
        new_row = []
        for t, value in enumerate(row):
            if t in prompts[i] or t in outputs[i]:
                value = value / repetition[i] if value > 0 else value * repetition[i]
            value -= frequency[i] * outputs[i].count(t)
            value -= presence[i] * (1.0 if t in outputs[i] else 0.0)
            new_row.append(value)
        result.append(new_row)
    return result


def test_penalties_match_reference(device: str) -> None:
    logits = [
        [2.0, -1.0, 0.5, -3.0, 1.5, 0.0],
        [1.0, 1.0, -2.0, 4.0, -0.5, 3.0],
        [0.3, -0.3, 0.7, -0.7, 0.1, 2.5],
    ]
    prompts = [[0, 1], [5, 5, 2], []]
    outputs = [[3, 3, 4], [], [0, 0, 0, 5]]
    presence = [0.5, 0.0, -1.0]
    frequency = [0.25, 1.0, 0.5]
    repetition = [1.5, 2.0, 0.8]
    params = [
        SamplingParams(presence_penalty=p, frequency_penalty=f, repetition_penalty=r)
        for p, f, r in zip(presence, frequency, repetition)
    ]
    md = build(params, 6, device, outputs=outputs, prompts=prompts)
    got = apply_penalties(torch.tensor(logits, device=device), md)
    want = reference_penalties(logits, prompts, outputs, presence, frequency, repetition)
    assert torch.allclose(got.cpu(), torch.tensor(want), atol=1e-6)


@pytest.mark.parametrize("which", ["presence", "frequency", "repetition"])
def test_each_penalty_alone_matches_reference(device: str, which: str) -> None:
    torch.manual_seed(7)
    logits = torch.randn(2, 8) * 2
    prompts, outputs = [[1, 2], [7]], [[2, 3, 3], [0, 7, 7, 7]]
    values = {"presence": [0.0, 0.0], "frequency": [0.0, 0.0], "repetition": [1.0, 1.0]}
    values[which] = [1.3, 0.7]
    params = [
        SamplingParams(
            presence_penalty=values["presence"][i],
            frequency_penalty=values["frequency"][i],
            repetition_penalty=values["repetition"][i],
        )
        for i in range(2)
    ]
    md = build(params, 8, device, outputs=outputs, prompts=prompts)
    got = apply_penalties(logits.to(device), md).cpu()
    want = reference_penalties(
        logits.tolist(),
        prompts,
        outputs,
        values["presence"],
        values["frequency"],
        values["repetition"],
    )
    assert torch.allclose(got, torch.tensor(want), atol=1e-6)
    assert not torch.allclose(got, logits)  # the penalty did something


def test_penalty_changes_greedy_choice(device: str) -> None:
    logits = torch.tensor([[5.0, 4.0, 1.0]], device=device)
    md = build([SamplingParams(temperature=0.0, frequency_penalty=2.0)], 3, device, outputs=[[0]])
    assert sample(logits, md).tolist() == [1]
    md = build([SamplingParams(temperature=0.0, repetition_penalty=2.0)], 3, device, prompts=[[0]])
    assert sample(logits, md).tolist() == [1]  # 5 / 2 < 4
    md = build([SamplingParams(temperature=0.0, presence_penalty=0.5)], 3, device, outputs=[[0]])
    assert sample(logits, md).tolist() == [0]  # 4.5 still wins


def test_logit_bias_forces_and_bans_tokens(device: str) -> None:
    torch.manual_seed(8)
    logits = torch.randn(6, 50, device=device)
    for temperature in (0.0, 1.0):
        p = SamplingParams(temperature=temperature, logit_bias={"17": 100})
        assert sample(logits, build([p] * 6, 50, device)).tolist() == [17] * 6
    top = logits.argmax(dim=-1)
    second = logits.topk(2, dim=-1).indices[:, 1]
    params = [SamplingParams(temperature=0.0, logit_bias={int(t): -100.0}) for t in top]
    assert torch.equal(sample(logits, build(params, 50, device)), second)
    # Rows without a bias are untouched by their neighbours' bias.
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 100.0}),
        SamplingParams(temperature=0.0),
    ]
    assert sample(logits[:2], build(params, 50, device)).tolist() == [3, int(top[1])]


def test_min_tokens_bans_eos_and_stop_tokens(device: str) -> None:
    # eos (2) is the favourite, stop token 4 the runner-up, then 1.
    logits = torch.tensor([[0.0, 3.0, 9.0, 0.5, 6.0]] * 3, device=device)
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4], ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4]),
    ]
    md = build(params, 5, device, outputs=[[1], [1], [1, 1, 1]], eos={2})
    assert sample(logits, md).tolist() == [1, 2, 2]
    # The random path never draws a masked token either.
    n = 2000
    md = build([SamplingParams(min_tokens=1)] * n, 5, device, eos=[2, 4])
    out = sample(torch.zeros(n, 5, device=device), md).cpu()
    assert set(out.tolist()) == {0, 1, 3}


# -- logprobs -------------------------------------------------------------------------------------


def test_logprobs_come_from_raw_logits(device: str) -> None:
    torch.manual_seed(9)
    # float32: bf16 rounding makes ties at the top, and a tie shares rank 1.
    logits = torch.randn(5, 40, device=device)
    params = [
        SamplingParams(logprobs=None),
        SamplingParams(temperature=0.0, logprobs=0, logit_bias={7: 50.0}),
        SamplingParams(temperature=0.3, logprobs=3, repetition_penalty=1.7),
        SamplingParams(temperature=0.0, logprobs=5, frequency_penalty=2.0),
        SamplingParams(top_k=4, logprobs=2),
    ]
    md = build(params, 40, device, outputs=[[1], [2], [3], [int(logits[3].argmax())] * 5, [5]])
    assert md.max_num_logprobs == 5
    out = Sampler()(logits, md)
    lp = out.logprobs
    assert lp is not None
    assert lp.token_ids.shape == (5, 6) and lp.token_ids.dtype == torch.int64
    assert lp.logprobs.shape == (5, 6) and lp.logprobs.dtype == torch.float32
    assert lp.ranks.shape == (5,) and lp.ranks.dtype == torch.int64

    raw = torch.log_softmax(logits.float(), dim=-1)
    sampled = out.sampled_token_ids
    assert torch.equal(lp.token_ids[:, 0], sampled)
    assert torch.allclose(lp.logprobs[:, 0], raw.gather(1, sampled[:, None])[:, 0])
    top = raw.topk(5, dim=-1)
    assert torch.allclose(lp.logprobs[:, 1:], top.values)
    assert torch.equal(raw.gather(1, lp.token_ids[:, 1:]), top.values)
    want_ranks = [int((raw[i] > raw[i, sampled[i]]).sum()) + 1 for i in range(5)]
    assert lp.ranks.tolist() == want_ranks
    # The biased and the penalized rows picked tokens that the raw logits do not favour.
    assert sampled[1] == 7 and lp.ranks[1] > 1
    assert lp.ranks[3] > 1


def test_no_logprobs_when_none_requested() -> None:
    out = Sampler()(torch.randn(2, 10), build([SamplingParams()] * 2, 10))
    assert out.logprobs is None


def test_compute_logprobs_tensors_for_prompt(device: str) -> None:
    torch.manual_seed(10)
    logits = torch.randn(7, 30, device=device, dtype=torch.float16)
    targets = torch.randint(0, 30, (7,), device=device)
    raw = torch.log_softmax(logits.float(), dim=-1)

    only = compute_logprobs_tensors(logits, targets, 0)
    assert only.token_ids.shape == (7, 1) and only.logprobs.dtype == torch.float32
    assert torch.allclose(only.logprobs[:, 0], raw.gather(1, targets[:, None])[:, 0])

    lp = compute_logprobs_tensors(logits, targets, 3)
    assert lp.token_ids.shape == (7, 4)
    assert torch.allclose(lp.logprobs[:, 1:], raw.topk(3, dim=-1).values)
    assert torch.equal(lp.ranks.cpu(), (raw > raw.gather(1, targets[:, None])).sum(-1).cpu() + 1)
    best = compute_logprobs_tensors(logits, raw.argmax(dim=-1), 1)
    assert best.ranks.tolist() == [1] * 7
    assert torch.equal(best.token_ids[:, 0], best.token_ids[:, 1])


def test_counter_sanity_of_seeded_sampling_distribution() -> None:
    # Seeded rows must still sample from the distribution, not collapse to one token.
    probs = [0.1, 0.2, 0.3, 0.4]
    n = 4000
    gens = {i: make_generator(i, "cpu") for i in range(n)}
    md = build([SamplingParams(seed=i) for i in range(n)], 4, generators=gens)
    out = sample(torch.tensor(probs).log().expand(n, -1).contiguous(), md)
    counts = Counter(out.tolist())
    got = torch.tensor([counts[i] for i in range(4)], dtype=torch.float32)
    assert chi_square(got, torch.tensor(probs)) < 25.0


def test_bad_words_ban_a_word_s_last_token_after_the_rest() -> None:
    """vLLM's bad_words: a one-token word always; a longer word's last token only where the
    output ends with the others (the prompt does not count)."""
    from shoal.sample.sampling_metadata import bad_word_bans

    words = [[5], [7, 8], [1, 2, 3]]
    assert bad_word_bans(words, []) == {5}
    assert bad_word_bans(words, [9, 7]) == {5, 8}
    assert bad_word_bans(words, [7, 9]) == {5}
    assert bad_word_bans(words, [1, 2]) == {5, 3}
    assert bad_word_bans(words, [2]) == {5}  # too short for [1, 2, 3]'s head
    sp = SamplingParams(bad_words_token_ids=[[4], [6, 2]])
    md = SamplingMetadata.build([sp, SamplingParams()], [[6], [6]], [[1], [1]], {}, {0}, 10,
                                "cpu")
    assert md.banned_token_ids == {0: [2, 4]}
    assert sp.needs_output_history and not SamplingParams(
        bad_words_token_ids=[[4]]).needs_output_history
