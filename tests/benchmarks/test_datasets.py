"""The datasets give the requested lengths, reproducibly."""

from __future__ import annotations

import json

import pytest

from shoal.benchmarks.datasets import (
    PrefixRepetitionSpec,
    RandomSpec,
    ShareGPTSpec,
    sample_prefix_repetition,
    sample_random,
    sample_sharegpt,
)


@pytest.fixture(scope="module")
def tokenizer():
    from shoal.benchmarks.serve import load_tokenizer_for

    return load_tokenizer_for("smollm2")  # cached: later tests in the process reuse it


def test_vllm_range_ratio_bounds():
    spec = RandomSpec.from_ratio(100, 10, range_ratio=0.5)
    assert spec.input_range == (50, 150) and spec.output_range == (5, 15)
    assert RandomSpec.from_ratio(30, 1, 0.9).output_range == (1, 2)  # output at least 1
    with pytest.raises(ValueError):
        RandomSpec.from_ratio(100, 10, range_ratio=1.0)


def test_random_token_ids_exact_lengths_and_seeded():
    spec = RandomSpec((100, 1024), (100, 1024), prefix_len=7, token_range=(0, 10000),
                      token_ids=True)
    reqs = sample_random(spec, 256, seed=0)
    assert len(reqs) == 256
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len
        assert 107 <= r.prompt_len <= 1031 and 100 <= r.expected_output_len <= 1024
        assert all(0 <= t < 10000 for t in r.prompt)
    assert len({tuple(r.prompt[:7]) for r in reqs}) == 1  # one shared prefix
    assert [r.prompt for r in sample_random(spec, 256, seed=0)] == [r.prompt for r in reqs]
    assert sample_random(spec, 4, seed=1)[0].prompt != reqs[0].prompt


def test_random_text_prompts_encode_to_the_requested_length(tokenizer):
    spec = RandomSpec.from_ratio(64, 16, range_ratio=0.25, prefix_len=8)
    reqs = sample_random(spec, 12, seed=0, tokenizer=tokenizer)
    for r in reqs:
        assert isinstance(r.prompt, str)
        assert len(tokenizer.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
        assert 8 + 48 <= r.prompt_len <= 8 + 80 and 12 <= r.expected_output_len <= 20


def test_prefix_repetition_shares_prefixes():
    spec = PrefixRepetitionSpec(prefix_len=32, suffix_len=8, num_prefixes=3, output_len=5,
                                token_ids=True)
    reqs = sample_prefix_repetition(spec, 10, seed=0)  # rounded down to 3 x 3
    assert len(reqs) == 9 and all(r.prompt_len == 40 and r.expected_output_len == 5
                                  for r in reqs)
    prefixes = [tuple(r.prompt[:32]) for r in reqs]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 3 for p in set(prefixes))
    with pytest.raises(ValueError):
        sample_prefix_repetition(spec, 2, seed=0)


def test_sharegpt_from_a_local_file(tmp_path, tokenizer):
    convs = [{"conversations": [{"from": "human", "value": f"Question number {i} about cats?"},
                                {"from": "gpt", "value": "An answer " * (i + 2)}]}
             for i in range(5)]
    convs.append({"conversations": [{"from": "human", "value": "hi"}]})  # one turn: skipped
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    reqs = sample_sharegpt(ShareGPTSpec(str(path)), 8, seed=0, tokenizer=tokenizer)
    assert len(reqs) == 8  # oversampled from 5
    for r in reqs:
        assert r.prompt_len == len(tokenizer.encode(r.prompt, add_special_tokens=False))
    fixed = sample_sharegpt(ShareGPTSpec(str(path), output_len=9, oversample=False), 8, 0,
                            tokenizer)
    assert len(fixed) == 5 and {r.expected_output_len for r in fixed} == {9}


def test_w1_preset_is_the_nano_vllm_request_set():
    from shoal.benchmarks.presets import SERVE_PRESETS, THROUGHPUT_PRESETS

    for presets in (SERVE_PRESETS, THROUGHPUT_PRESETS):
        reqs = sample_random(presets["W1"].random, 256, 0)
        # BENCHMARKS.md: 133,966 output tokens in total (nano-vllm's bench.py at seed 0)
        assert sum(r.expected_output_len for r in reqs) == 133_966
        assert all(100 <= r.prompt_len <= 1024 and max(r.prompt) <= 10_000 for r in reqs)
