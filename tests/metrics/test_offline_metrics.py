"""LLM.get_metrics (vLLM's): with disable_log_stats=False the offline engine keeps vLLM's
series, counted as the server counts them; a request of n samples is n finished requests and
one n; speculative decoding's accepted tokens per position come as one Vector."""

from __future__ import annotations

import pytest
from engine_helpers import random_prompts, tiny_llm

from shoal import SamplingParams
from shoal.metrics.reader import Counter, Histogram, Vector


def _by_name(metrics) -> dict:
    return {m.name: m for m in metrics}


def test_get_metrics_counts_what_generate_ran(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir, disable_log_stats=False)
    prompts = random_prompts(2, seed=31, lo=8, hi=9)
    llm.generate(prompts, SamplingParams(n=2, max_tokens=5, ignore_eos=True, seed=1),
                 use_tqdm=False)
    metrics = llm.get_metrics()
    success = [m for m in metrics if m.name == "vllm:request_success"
               and m.labels["finished_reason"] == "length"]
    assert isinstance(success[0], Counter) and success[0].value == 4  # 2 prompts x n=2
    m = _by_name(metrics)
    assert m["vllm:generation_tokens"].value == 4 * 5
    assert m["vllm:prompt_tokens"].value == 4 * 8  # each sample's prompt, as vLLM counts
    n = m["vllm:request_params_n"]
    assert isinstance(n, Histogram) and (n.count, n.sum) == (2, 4.0)
    assert n.buckets["+Inf"] == 2
    assert m["vllm:request_generation_tokens"].count == 4
    assert all(name.startswith("vllm:") for name in m)


def test_get_metrics_needs_statistics(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)  # LLM's default: disable_log_stats=True
    with pytest.raises(ValueError, match="disable_log_stats=False"):
        llm.get_metrics()


def test_accepted_tokens_per_position_are_one_vector(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir, disable_log_stats=False, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3})
    repeat = [{"prompt_token_ids": [7, 8, 9, 10] * 6}]
    llm.generate(repeat, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                 use_tqdm=False)
    m = _by_name(llm.get_metrics())
    drafts = m["vllm:spec_decode_num_drafts"].value
    per_pos = m["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert drafts > 0 and isinstance(per_pos, Vector) and len(per_pos.values) == 3
    assert sum(per_pos.values) == m["vllm:spec_decode_num_accepted_tokens"].value
    assert per_pos.values == sorted(per_pos.values, reverse=True)  # a later one needs the earlier


@pytest.mark.parametrize("disabled", [False, True])
def test_disable_log_stats_drops_the_server_s_log_line_not_its_metrics(disabled):
    from types import SimpleNamespace

    from shoal.engine.engine_args import EngineArgs
    from shoal.engine.request_checks import EngineLimits
    from shoal.entrypoints.openai.api_server_pool import engine_loggers
    from shoal.entrypoints.openai.server_settings import ServerSettings
    from shoal.metrics import LoggingStatLogger, PrometheusStatLogger

    ready = SimpleNamespace(limits=EngineLimits(vocab_size=8, max_model_len=64,
                                                num_kv_blocks=4, block_size=16, max_num_seqs=2))
    loggers = engine_loggers(EngineArgs(disable_log_stats=disabled), ServerSettings(), ready)
    assert isinstance(loggers[0], PrometheusStatLogger)
    assert [type(sl) for sl in loggers[1:]] == ([] if disabled else [LoggingStatLogger])
