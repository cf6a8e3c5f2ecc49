"""Data parallelism behind one server (shoal/engine/dp_client.py): two engine processes,
requests spread over both, every answer what one engine gives, metrics for the whole server; a
replica killed under load fails only its own requests while the other keeps serving."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from shoal import LLM, SamplingParams
from shoal.core.types import SchedulerStats
from shoal.engine.dp_client import merge_limits
from shoal.engine.request_checks import EngineLimits
from shoal.metrics.stats import merge_engine_stats

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
        # per engine, as vLLM labels them: both replicas served some of the prompts
        done = {engine: float(v) for engine, v in re.findall(
            r'^vllm:request_success_total\{engine="(\d)",finished_reason="length"[^}]*\} (\S+)',
            metrics, re.M)}
        assert sum(done.values()) == len(PROMPTS) and done["0"] > 0 and done["1"] > 0, done
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
    merged = merge_engine_stats([s1, s2], s2)
    assert (merged.num_running, merged.num_waiting, merged.prefix_cache_hits) == (5, 1, 12)
    assert merged.kv_cache_usage == pytest.approx(0.3)
    assert merged.num_generation_tokens == 2  # the step's own count, never summed again


def test_offline_refuses_data_parallel():
    with pytest.raises(ValueError, match="data_parallel_size > 1 runs replicas"):
        LLM(model=None, data_parallel_size=2)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    stat = Path(f"/proc/{pid}/stat")  # a zombie not reaped yet is gone too
    return not stat.exists() or stat.read_text().split(")")[-1].split()[0] == "Z"


def test_a_killed_replica_leaves_the_other_serving(tiny_llama_dir):
    """Two long streams, one per replica; replica 1 killed (SIGKILL): its stream ends with an
    error within seconds, the other finishes, new requests are answered by replica 0 as before
    and /health stays 200. Killing replica 0 too ends the server (503 or gone), no process left."""
    import openai
    from entrypoints.conftest import RemoteServer

    model = str(tiny_llama_dir)
    server = RemoteServer(model, "--data-parallel-size", "2", "--device", "cpu", "--dtype",
                          "float32", "--max-model-len", "512", "--max-num-seqs", "4",
                          base_args=["--kv-cache-memory-bytes", str(2**22),
                                     "--disable-uvicorn-access-log"])
    try:
        pids = {int(r): int(p) for r, p in re.findall(r"engine replica (\d+) of 2: pid (\d+)",
                                                      server.log_tail(200000))}
        assert sorted(pids) == [0, 1], server.log_tail()
        client = server.openai()
        greedy = dict(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                      extra_body={"ignore_eos": True})
        before = client.completions.create(**greedy).choices[0].text

        long = dict(model=model, max_tokens=480, temperature=0, stream=True,
                    extra_body={"ignore_eos": True})
        on_0 = iter(client.completions.create(prompt=PROMPTS[1], **long))
        next(on_0)  # in flight on replica 0, so the next one goes to replica 1
        on_1 = iter(client.completions.create(prompt=PROMPTS[2], **long))
        next(on_1)
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(openai.APIError, match="replica 1 died"):
            for _ in on_1:
                pass
        assert time.monotonic() - t0 < 10
        finish = [c.choices[0].finish_reason for c in on_0]
        assert finish[-1] == "length"  # replica 0's request was not touched

        for _ in range(3):  # every new request goes to the survivor and is answered as before
            assert client.completions.create(**greedy).choices[0].text == before
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
        running = dict(re.findall(r'^vllm:num_requests_running\{engine="(\d)"[^}]*\} (\S+)',
                                  httpx.get(server.base_url + "/metrics").text, re.M))
        assert float(running["1"]) == 0  # the dead replica's gauges dropped to zero

        os.kill(pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 10
        health = 200
        while time.monotonic() < deadline and health == 200:
            try:
                health = httpx.get(server.base_url + "/health", timeout=5).status_code
            except httpx.HTTPError:
                health = None  # the server exited after its grace period: as good as a 503
            time.sleep(0.1)
        assert health in (None, 503)
        while time.monotonic() < deadline and not all(_gone(p) for p in pids.values()):
            time.sleep(0.2)
        assert all(_gone(p) for p in pids.values()), server.log_tail()
    finally:
        server.stop()


def _null_replicas(max_num_seqs: int, **kwargs):
    """Engine arguments and a build_core for two model-free replicas (NullEngineCore)."""
    import functools

    from shoal.benchmarks.null_engine import build_null_core
    from shoal.engine.engine_args import EngineArgs

    args = EngineArgs(device="cpu", data_parallel_size=2, max_num_seqs=max_num_seqs,
                      max_model_len=64, cpu_threads=1, **kwargs)
    return args, functools.partial(build_null_core, step_time_s=0.01, vocab_size=100)


async def _until_dead(client, timeout: float = 10.0) -> None:
    import asyncio

    deadline = time.monotonic() + timeout
    while not client.dead and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert client.dead


def test_a_dead_replicas_share_of_max_num_seqs_leaves_the_limit():
    """The batch the replicas still running can hold: 2 x 4, then 4 once replica 1 died (the
    frontend's queue limit is this plus max_waiting_requests)."""
    import asyncio

    from shoal.engine.dp_client import DataParallelCoreClient

    async def run() -> tuple[int, int, int]:
        args, build = _null_replicas(4)
        client = await DataParallelCoreClient.start(args, build_core=build)
        try:
            ready = await client.wait_ready(60)
            both = client.max_num_seqs
            os.kill(client.clients[1].proc.pid, signal.SIGKILL)
            await _until_dead(client.clients[1])
            return ready.limits.max_num_seqs, both, client.max_num_seqs
        finally:
            await client.shutdown()

    assert asyncio.run(run()) == (8, 8, 4)


def test_the_frontend_queue_limit_drops_a_dead_replicas_share():
    import asyncio

    from shoal.engine.async_llm import AsyncLLM

    async def run() -> None:
        args, build = _null_replicas(2, max_waiting_requests=0, skip_tokenizer_init=True)
        engine = await AsyncLLM.from_engine_args(args, build_core=build, startup_timeout=60,
                                                 log_stats_interval=3600)
        try:
            engine._check_queue(4)  # two replicas of 2: four sequences fit
            os.kill(engine.client.clients[1].proc.pid, signal.SIGKILL)
            await _until_dead(engine.client.clients[1])
            with pytest.raises(ValueError, match=r"max_num_seqs \+ max_waiting_requests = 2"):
                engine._check_queue(4)
        finally:
            await engine.shutdown()

    asyncio.run(run())
