"""Data parallelism behind one server (shoal/engine/dp_client.py): two engine processes,
requests spread over both, every answer what one engine gives, metrics for the whole server."""

from __future__ import annotations

import re

import httpx
import pytest

from shoal import LLM, SamplingParams
from shoal.engine.core_types import SchedulerStats
from shoal.engine.dp_client import _sum_stats, merge_limits
from shoal.engine.input_processor import EngineLimits

PROMPTS = [[5, 17, 300, 42, 7, 99], [256, 3, 11, 400, 23, 8], [9, 9, 9], [1, 2, 3, 4]]


def test_two_replicas_serve_what_one_engine_does(tiny_llama_dir):
    from entrypoints.conftest import RemoteServer

    llm = LLM(model=str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=2**22)
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = [list(o.outputs[0].token_ids) for o in llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)]
    llm.shutdown()
    server = RemoteServer(str(tiny_llama_dir), "--data-parallel-size", "2", "--device", "cpu",
                          "--dtype", "float32", "--max-model-len", "128",
                          "--max-num-seqs", "4")
    try:
        client = server.openai()
        # One request with all prompts (n sequences spread over the replicas), then each alone.
        out = client.completions.create(model=str(tiny_llama_dir), prompt=PROMPTS,
                                        max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True,
                                                    "return_token_ids": True})
        assert [list(c.token_ids) for c in sorted(out.choices, key=lambda c: c.index)] == expected
        metrics = httpx.get(server.base_url + "/metrics").text
        done = re.search(r'^vllm:request_success_total\{[^}]*finished_reason="length"[^}]*\} '
                         r'(\S+)', metrics, re.M)
        assert done is not None and float(done.group(1)) == len(PROMPTS)
        engines = {int(p) for p in re.findall(r"engine core process (\d+) ready",
                                                server.log_tail(20000))}
        assert len(engines) == 2  # two engine processes really started
    finally:
        server.stop()


def test_merged_limits_and_stats():
    a = EngineLimits(vocab_size=512, max_model_len=128, num_kv_blocks=100, block_size=16,
                     max_num_seqs=8)
    b = EngineLimits(vocab_size=512, max_model_len=128, num_kv_blocks=80, block_size=16,
                     max_num_seqs=8)
    m = merge_limits([a, b])
    assert (m.num_kv_blocks, m.max_num_seqs) == (80, 16)
    s1 = SchedulerStats(num_running=3, num_waiting=1, kv_cache_usage=0.5, prefix_cache_hits=7,
                        num_generation_tokens=3)
    s2 = SchedulerStats(num_running=2, kv_cache_usage=0.1, prefix_cache_hits=5,
                        num_generation_tokens=2)
    merged = _sum_stats([s1, s2], s2)
    assert (merged.num_running, merged.num_waiting, merged.prefix_cache_hits) == (5, 1, 12)
    assert merged.kv_cache_usage == pytest.approx(0.3)
    assert merged.num_generation_tokens == 2  # the step's own count, never summed again


def test_offline_refuses_data_parallel():
    with pytest.raises(ValueError, match="data_parallel_size > 1 runs replicas"):
        LLM(model=None, data_parallel_size=2)
