"""Speculative decoding with data-parallel replicas (shoal/engine/dp_client.py): each replica is
an engine process of its own with its own drafter. Two replicas on the CPU behind one AsyncLLM
(as `shoal serve --data-parallel-size 2` runs them), with ngram and with a draft model: every
request's greedy tokens are the plain engine's and the one speculative engine's; each replica
verified drafts of its own requests; and the spec_decode counters the server shows (the
Prometheus series per engine, as vLLM labels them, and the log line over all engines) add up
over the replicas to the one engine's."""

from __future__ import annotations

import asyncio
import re

import pytest
import torch
from engine_helpers import random_prompts, tiny_llm
from prometheus_client import CollectorRegistry
from spec_decode.test_spec_engine import SpecCounter
from spec_decode.test_spec_tensor_parallel import draft_dir, ngram_prompts  # noqa: F401

from shoal import SamplingParams
from shoal.engine.engine_args import EngineArgs
from shoal.metrics.logging_stats import LoggingStatLogger
from shoal.metrics.prometheus import PrometheusStatLogger

K = 3
PROMPTS = random_prompts(3, seed=11, lo=4, hi=24)
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
ENGINE = dict(dtype="float32", block_size=4, max_model_len=256, num_gpu_blocks_override=512)
COUNTERS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
            "spec_decode_num_accepted_tokens")


def _one_engine(target, spec: dict | None, prompts) -> tuple[list[list[int]], tuple[int, ...]]:
    llm = tiny_llm(target, speculative_config=spec)
    try:
        counter = SpecCounter(llm)
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        return ([list(o.outputs[0].token_ids) for o in outs],
                (counter.drafts, counter.draft_tokens, counter.accepted))
    finally:
        llm.shutdown()


async def _two_replicas(target, spec: dict, prompts):
    """Greedy tokens of the prompts sent at once, each replica's counters (engine -> drafts,
    draft tokens, accepted: the Prometheus series) and the log line."""
    from shoal.engine.async_llm import AsyncLLM

    args = EngineArgs(model=str(target), device="cpu", data_parallel_size=2, cpu_threads=1,
                      speculative_config=spec, skip_tokenizer_init=True, **ENGINE)
    engine = await AsyncLLM.from_engine_args(args, startup_timeout=120,
                                             log_stats_interval=3600)
    prometheus, log = PrometheusStatLogger("m", CollectorRegistry()), LoggingStatLogger()
    engine.stat_loggers += [prometheus, log]
    try:
        async def one(i: int, prompt: dict) -> list[int]:
            async for out in engine.generate(prompt, GREEDY, f"r{i}"):
                last = out
            return list(last.outputs[0].token_ids)
        tokens = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        line = log.format_line()
    finally:
        await engine.shutdown()
    per_engine = {e: tuple(int(prometheus.registry.get_sample_value(
        f"vllm:{name}_total", {"model_name": "m", "engine": e}) or 0) for name in COUNTERS)
        for e in ("0", "1")}
    return tokens, per_engine, line


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_two_replicas_speculate_as_one_engine_does(method, eagle_ckpts, request):
    torch.set_num_threads(1)
    target = eagle_ckpts["bigram"][0]  # its next token a function of the current one
    spec: dict = {"method": method, "num_speculative_tokens": K}
    prompts = PROMPTS
    if method == "ngram":
        prompts = request.getfixturevalue("ngram_prompts")
    else:
        spec["model"] = str(request.getfixturevalue("draft_dir"))
    plain, _ = _one_engine(target, None, prompts)
    one, counts = _one_engine(target, spec, prompts)
    two, per_engine, line = asyncio.run(_two_replicas(target, spec, prompts))
    assert one == plain and two == plain
    # r0 and r2 went to replica 0, r1 to replica 1 (the fewest requests in flight): each
    # drafted for its own, and together they verified what the one engine did
    assert all(drafts > 0 for drafts, _, _ in per_engine.values()), per_engine
    assert tuple(map(sum, zip(*per_engine.values()))) == counts
    drafts, draft_tokens, accepted = counts
    assert drafts > 0 and 0 < accepted <= draft_tokens <= K * drafts
    rate = re.search(r"draft acceptance rate: ([\d.]+)%, Mean acceptance length: ([\d.]+)",
                     line or "")
    assert rate is not None, line
    assert float(rate[1]) == pytest.approx(100 * accepted / draft_tokens, abs=0.06)
    assert float(rate[2]) == pytest.approx(1 + accepted / drafts, abs=0.006)
