"""The serving benchmark client against a fake SSE server (no model)."""

from __future__ import annotations

import asyncio
import json

import httpx

from shoal.benchmarks.serve import random_prompts, run_benchmark, summarize


def _sse_handler(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    assert body["ignore_eos"] and body["stream"] and isinstance(body["prompt"], list)
    if body["prompt"][0] % 2 == 1 and body["prompt"][0] > 9990:
        return httpx.Response(503, json={"error": {"message": "busy"}})
    events = [{"choices": [{"index": 0, "text": "x"}]} for _ in range(body["max_tokens"])]
    events.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                            "completion_tokens": body["max_tokens"]}})
    text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})


def test_benchmark_counts_tokens_and_latencies():
    prompts = random_prompts(6, 5, 100, 200, seed=1)
    assert len(prompts) == 6 and all(len(p) == 5 for p in prompts)
    assert random_prompts(6, 5, 100, 200, seed=1) == prompts

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(_sse_handler),
                                     base_url="http://test") as client:
            return await run_benchmark(client, "m", prompts, 4, max_concurrency=2)

    results, duration = asyncio.run(go())
    s = summarize(results, duration)
    assert s["completed"] == 6 and s["failed"] == 0
    assert s["total_output_tokens"] == 24 and s["total_input_tokens"] == 30
    assert all(len(r.itls) == 3 for r in results)
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "mean_e2e_ms"):
        assert s[key] >= 0


def test_failures_are_counted():
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(_sse_handler),
                                     base_url="http://test") as client:
            return await run_benchmark(client, "m", [[9991, 1], [5, 1]], 2, max_concurrency=4)

    results, duration = asyncio.run(go())
    s = summarize(results, duration)
    assert (s["completed"], s["failed"]) == (1, 1) and "503" in s["first_errors"][0]
