"""SamplingParams: defaults, normalization, one rejection per invalid field, derived views."""

from __future__ import annotations

import re

import pytest

from shoal.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert p.seed is None and p.logprobs is None and p.prompt_logprobs is None
    assert p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop == [] and p.stop_token_ids == [] and p.logit_bias is None
    assert p.skip_special_tokens and p.spaces_between_special_tokens and p.detokenize
    assert not p.ignore_eos and not p.include_stop_str_in_output


def test_normalization() -> None:
    p = SamplingParams(stop="###", top_k=-1, logit_bias={"42": 5, 7: -1.5}, stop_token_ids=(3,))
    assert p.stop == ["###"]
    assert p.top_k == 0
    assert p.logit_bias == {42: 5.0, 7: -1.5}
    assert all(type(k) is int for k in p.logit_bias)
    assert p.stop_token_ids == [3]
    assert SamplingParams(temperature=1).temperature == 1.0
    assert isinstance(SamplingParams(temperature=1).temperature, float)
    assert SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    assert SamplingParams(max_tokens=None, min_tokens=500).max_tokens is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 0),
        ("n", 1.5),
        ("n", True),
        ("temperature", -1.0),
        ("temperature", "hot"),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0),
        ("top_p", 1.01),
        ("top_p", -0.5),
        ("top_p", None),
        ("top_k", -2),
        ("top_k", True),
        ("top_k", 2.0),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3),
        ("frequency_penalty", -3),
        ("frequency_penalty", "x"),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("seed", 1.5),
        ("seed", "7"),
        ("seed", True),
        ("seed", 2**64),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("max_tokens", 3.0),
        ("min_tokens", -1),
        ("min_tokens", 1.0),
        ("logprobs", -2),  # -1 is the whole vocabulary; the engine's max_logprobs caps the rest
        ("logprobs", 1.0),
        ("prompt_logprobs", -2),
        ("prompt_logprobs", "3"),
        ("stop", ""),
        ("stop", [""]),
        ("stop", ["ok", 5]),
        ("stop", 5),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.5]),
        ("stop_token_ids", 7),
        ("stop_token_ids", [True]),
        ("logit_bias", {1: 101}),
        ("logit_bias", {1: -100.5}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"-3": 1.0}),
        ("logit_bias", {"abc": 1.0}),
        ("logit_bias", {1.5: 1.0}),
        ("logit_bias", {1: "big"}),
        ("logit_bias", [1, 2]),
        ("ignore_eos", 1),
        ("skip_special_tokens", "yes"),
        ("spaces_between_special_tokens", None),
        ("include_stop_str_in_output", 0),
        ("detokenize", "false"),
    ],
)
def test_invalid_field_is_rejected_by_name(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"\b{re.escape(field)}\b"):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_names_both() -> None:
    with pytest.raises(ValueError, match=r"min_tokens.*max_tokens"):
        SamplingParams(min_tokens=20, max_tokens=10)


def test_messages_state_range_and_value() -> None:
    with pytest.raises(ValueError, match=re.escape("temperature must be >= 0 (got -1.0)")):
        SamplingParams(temperature=-1.0)
    with pytest.raises(ValueError, match=re.escape("top_p must be in (0, 1] (got 0.0)")):
        SamplingParams(top_p=0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3},
        {"logprobs": 0, "prompt_logprobs": MAX_LOGPROBS},
        {"seed": -(2**63)},
        {"seed": 2**64 - 1},
        {"logit_bias": {0: -100, 5: 100}},
        {"max_tokens": 1, "min_tokens": 1},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict) -> None:
    SamplingParams(**kwargs)


def test_sampling_type() -> None:
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6, seed=3).is_greedy
    assert SamplingParams(temperature=0.5).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.5, seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert not SamplingParams(temperature=0.5).is_greedy


def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[1], logit_bias={2: 1.0})
    c = p.clone()
    assert c == p
    c.stop.append("y")
    c.stop_token_ids.append(9)
    c.logit_bias[3] = 2.0
    assert p.stop == ["x"] and p.stop_token_ids == [1] and p.logit_bias == {2: 1.0}


def test_for_sample_offsets_seed() -> None:
    p = SamplingParams(n=4, seed=100, temperature=0.8, stop=["s"])
    children = [p.for_sample(i) for i in range(4)]
    assert [c.seed for c in children] == [100, 101, 102, 103]
    assert all(c.n == 1 for c in children)
    assert all(c.temperature == 0.8 and c.stop == ["s"] for c in children)
    assert p.n == 4 and p.seed == 100  # parent untouched
    children[0].stop.append("t")
    assert p.stop == ["s"]
    # Same request, same seeds: reproducible.
    assert [c.seed for c in children] == [p.for_sample(i).seed for i in range(4)]


def test_for_sample_without_seed_and_bounds() -> None:
    p = SamplingParams(n=2)
    assert p.for_sample(1).seed is None and p.for_sample(1).n == 1
    with pytest.raises(ValueError, match="index"):
        p.for_sample(2)
    with pytest.raises(ValueError, match="index"):
        p.for_sample(-1)
    # Seeds past the u64 range wrap instead of producing an unusable seed.
    assert SamplingParams(n=2, seed=2**64 - 1).for_sample(1).seed == 0


def test_validate_against_vocab() -> None:
    SamplingParams(logit_bias={9: 1.0}, stop_token_ids=[9]).validate_against_vocab(10)
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={10: 1.0}).validate_against_vocab(10)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[3, 12]).validate_against_vocab(10)
