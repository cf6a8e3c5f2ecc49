"""Online-serving benchmark (workload W4): an async OpenAI-style load client.

Sends random token-id prompts of a fixed input length to /v1/completions with streaming,
`ignore_eos` and a fixed output length, at most `--max-concurrency` at a time (optionally
paced by a Poisson `--request-rate`), and reports TTFT, TPOT, ITL and end-to-end latency
(mean / median / p99) plus throughput. One streamed chunk carries one token here.

    shoal bench serve --input-len 256 --output-len 64 --num-prompts 64 --max-concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def random_prompts(n: int, input_len: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(input_len)] for _ in range(n)]


async def send_one(client: httpx.AsyncClient, model: str, prompt: list[int],
                   output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "min_tokens": output_len,
            "ignore_eos": True, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    res = RequestResult(prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = data["error"].get("message", "error")
                    return res
                if data.get("usage"):
                    res.output_tokens = data["usage"]["completion_tokens"]
                    res.prompt_tokens = data["usage"]["prompt_tokens"]
                if not data.get("choices"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itls.append(now - last)
                last = now
                chunks += 1
        res.e2e = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_benchmark(client: httpx.AsyncClient, model: str, prompts: list[list[int]],
                        output_len: int, max_concurrency: int,
                        request_rate: float = float("inf"), seed: int = 0,
                        ) -> tuple[list[RequestResult], float]:
    """All results (in prompt order) and the wall time of the run."""
    sem = asyncio.Semaphore(max_concurrency)
    rng = random.Random(seed)

    async def limited(p: list[int]) -> RequestResult:
        async with sem:
            return await send_one(client, model, p, output_len)

    start = time.perf_counter()
    tasks = []
    for p in prompts:
        tasks.append(asyncio.create_task(limited(p)))
        if request_rate != float("inf"):
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - start


def _stats(values: list[float], prefix: str) -> dict[str, float]:
    if not values:
        return {f"mean_{prefix}_ms": 0.0, f"median_{prefix}_ms": 0.0, f"p99_{prefix}_ms": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {f"mean_{prefix}_ms": statistics.fmean(values) * 1000,
            f"median_{prefix}_ms": statistics.median(values) * 1000,
            f"p99_{prefix}_ms": p99 * 1000}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration, "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
    }
    summary |= _stats([r.ttft for r in ok], "ttft")
    summary |= _stats([t for r in ok if (t := r.tpot) is not None], "tpot")
    summary |= _stats([x for r in ok for x in r.itls], "itl")
    summary |= _stats([r.e2e for r in ok], "e2e")
    errors = [r.error for r in results if r.error]
    if errors:
        summary["first_errors"] = errors[:3]
    return summary


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="default: the server's first model")
    p.add_argument("--api-key", default=None)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--max-concurrency", type=int, default=16)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson arrivals); inf sends all at once")
    p.add_argument("--token-low", type=int, default=100, help="random prompt ids from here")
    p.add_argument("--token-high", type=int, default=10000, help="... up to here (exclusive)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="write the JSON result here")


async def _main(ns: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    timeout = httpx.Timeout(None, connect=30)
    limits = httpx.Limits(max_connections=ns.max_concurrency + 4)
    async with httpx.AsyncClient(base_url=ns.base_url, headers=headers, timeout=timeout,
                                 limits=limits) as client:
        model = ns.model
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        prompts = random_prompts(ns.num_prompts, ns.input_len, ns.token_low, ns.token_high,
                                 ns.seed)
        results, duration = await run_benchmark(client, model, prompts, ns.output_len,
                                                 ns.max_concurrency, ns.request_rate, ns.seed)
    return {"workload": "W4", "command": " ".join(sys.argv), "model": model,
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
            "params": {k: v for k, v in vars(ns).items() if k != "api_key"},
            "summary": summarize(results, duration),
            "requests": [asdict(r) | {"itls": None} for r in results]}


def main(ns: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise
    result = asyncio.run(_main(ns))
    s = result["summary"]
    for key, value in s.items():
        print(f"{key:>24}: {value:.2f}" if isinstance(value, float) else f"{key:>24}: {value}")
    if ns.result_file:
        with open(ns.result_file, "w") as f:
            json.dump(result, f, indent=1, default=str)
    return 0 if s["failed"] == 0 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_flags(parser)
    sys.exit(main(parser.parse_args()))
