"""speculative_config: vLLM's dict shape, and a clear error for every bad value."""

from __future__ import annotations

import pytest
from engine_helpers import tiny_llm

from shoal.cli import build_parser
from shoal.config.speculative import SpeculativeConfig
from shoal.entrypoints.cli_args import engine_args_from
from shoal.spec_decode.ngram import propose_ngram


def test_vllm_shapes() -> None:
    c = SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 4,
                                     "prompt_lookup_min": 2, "prompt_lookup_max": 5})
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (
        "ngram", 4, 2, 5)
    # vLLM's older spelling: model "[ngram]"; one lookup bound sets both
    c = SpeculativeConfig.from_user({"model": "[ngram]", "num_speculative_tokens": 3,
                                     "prompt_lookup_max": 3})
    assert (c.method, c.model, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", None, 3, 3)
    c = SpeculativeConfig.from_user('{"method": "ngram", "num_speculative_tokens": 2}')
    assert c.num_speculative_tokens == 2


@pytest.mark.parametrize(("value", "message"), [
    ({"method": "medusa2", "num_speculative_tokens": 2}, "unknown method 'medusa2'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": -3}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2.5}, "num_speculative_tokens must be"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"num_speculative_tokens": 2}, "needs 'method'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "prompt_lookup_min <= prompt_lookup_max"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     "prompt_lookup_min"),
    ({"method": "eagle3", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "suffix", "num_speculative_tokens": 2}, "not supported yet"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "medusa", "num_speculative_tokens": 1}, "not supported yet"),
    ({"method": "mtp", "num_speculative_tokens": 1, "model": "x"}, "takes no 'model'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
     "disable_by_batch_size must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "adaptive_budget": "yes"},
     "adaptive_budget must be true or false"),
    ({"method": "ngram", "num_speculative_tokens": 2, "acceptance_rate": 0.5},
     "acceptance_rate is for the test-only"),
    ({"method": "test_forced_acceptance", "num_speculative_tokens": 2,
      "acceptance_rate": 1.5}, "acceptance_rate must be in"),
    ("{not json", "not valid JSON"),
    ([1, 2], "must be a dict"),
])
def test_bad_values_name_the_field(value, message) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_user(value)


def test_engine_rejects_bad_config_and_a_draft_with_another_vocabulary(tiny_llama_dir,
                                                                     tmp_path) -> None:
    from oracle import write_tiny_checkpoint

    with pytest.raises(ValueError, match="num_speculative_tokens"):
        tiny_llm(tiny_llama_dir, speculative_config={"method": "ngram",
                                                     "num_speculative_tokens": 0})
    other = write_tiny_checkpoint(tmp_path / "other-vocab", "llama", vocab_size=384)
    with pytest.raises(ValueError, match="another vocabulary"):
        tiny_llm(tiny_llama_dir, speculative_config={
            "method": "draft_model", "model": str(other), "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="no-such-draft"):
        tiny_llm(tiny_llama_dir, speculative_config={
            "method": "draft_model", "model": str(tmp_path / "no-such-draft"),
            "num_speculative_tokens": 3})


def test_serve_flag_takes_json() -> None:
    ns = build_parser().parse_args(
        ["serve", "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}'])
    args = engine_args_from(ns)
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 4,
                                       "prompt_lookup_max": 4}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", "{oops"])


def test_serve_answers_a_bad_config_before_loading_anything(capsys) -> None:
    from shoal.cli import main

    assert main(["serve", "--speculative-config",
                 '{"method": "medusa", "num_speculative_tokens": 2}']) == 2
    assert "method 'medusa' is not supported yet" in capsys.readouterr().err


def test_ngram_proposer() -> None:
    toks = [1, 2, 3, 4, 9, 1, 2, 3]
    assert propose_ngram(toks, 3, 1, 3) == [4, 9, 1]  # suffix 1,2,3 seen at 0
    assert propose_ngram(toks, 10, 1, 3) == [4, 9, 1, 2, 3]  # up to the end
    assert propose_ngram([5, 6, 7], 2, 1, 3) == []  # nothing repeats
    assert propose_ngram([1, 2, 7, 1, 2, 8, 2], 2, 1, 1) == [8, 2]  # latest match wins
    assert propose_ngram([1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2) == [8, 1]
    assert propose_ngram([4, 4, 4, 4], 3, 2, 3) == [4]  # a match must leave a token to copy
    assert propose_ngram([3, 1, 2, 3], 2, 2, 3) == []  # min_n: a one-token match is not enough


def _reference_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        for start in range(total - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[total - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_matches_a_plain_scan() -> None:
    import random

    rng = random.Random(0)
    for _ in range(300):
        toks = [rng.randrange(6) for _ in range(rng.randrange(1, 40))]
        k, lo = rng.randrange(1, 6), rng.randrange(1, 4)
        hi = lo + rng.randrange(0, 3)
        assert propose_ngram(toks, k, lo, hi) == _reference_ngram(toks, k, lo, hi), toks
