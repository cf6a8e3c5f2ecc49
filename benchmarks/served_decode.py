"""Batch-1 decode through `shoal serve`: one streaming /v1/completions request of token ids at
a time, decode tok/s = (tokens - 1) / (last chunk - first chunk), the figure a user's client
sees (HTTP, detokenizing, the frontend-engine hop included). Standard library only.

    with ServerProcess(cmd, port) as server:
        row = served_batch1(server.url, model_name(server.url), prompts, 256)
"""

from __future__ import annotations

import json
import statistics
import time
import urllib.request
from typing import Any


def model_name(url: str, timeout: float = 10.0) -> str:
    """The first model /v1/models lists (the name requests must carry)."""
    with urllib.request.urlopen(url + "/v1/models", timeout=timeout) as r:
        return json.loads(r.read())["data"][0]["id"]


def stream_completion(url: str, model: str, prompt_ids: list[int], max_tokens: int,
                      timeout: float = 300.0) -> dict[str, Any]:
    """One greedy streaming request (ignore_eos): its TTFT, decode tok/s and token count."""
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    rq = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                headers={"Content-Type": "application/json"})
    t0, first, last, tokens = time.perf_counter(), None, None, 0
    with urllib.request.urlopen(rq, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                last = time.perf_counter()
                first = first or last
    decode = (tokens - 1) / (last - first) if first and last and last > first else None
    return {"decode_tok_s": decode, "ttft_s": (first or t0) - t0, "output_tokens": tokens,
            "total_s": (last or t0) - t0}


def served_batch1(url: str, model: str, prompts: list[list[int]], max_tokens: int,
                  timeout: float = 300.0) -> dict[str, Any]:
    """A warm-up request on prompts[0], then one request per remaining prompt; the median
    run's figures by decode rate, and every run's rate."""
    stream_completion(url, model, prompts[0], max_tokens, timeout)
    runs = [stream_completion(url, model, p, max_tokens, timeout) for p in prompts[1:]]
    rates = [r["decode_tok_s"] or 0.0 for r in runs]
    median = sorted(runs, key=lambda r: r["decode_tok_s"] or 0.0)[len(runs) // 2]
    return {**median, "runs": len(runs), "all_runs_decode_tok_s": rates,
            "median_decode_tok_s": statistics.median(rates)}
