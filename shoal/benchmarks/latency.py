"""`shoal bench latency`: the latency of one batch through `shoal.LLM`, as `vllm bench latency`.

Each iteration generates `--output-len` tokens (ignore_eos) for `--batch-size` prompts of
`--input-len` random token ids in [0, 10000); after `--num-iters-warmup` untimed iterations,
`--num-iters` are timed. Printed: the average and percentiles of the batch latency, and
shoal's additions: output tok/s and, from the engine's per-request times, the mean TTFT and
the decode rate (output tokens after the first over the time after the first), the W2 / W6
batch-1 figure.

    shoal bench latency --preset W6
    shoal bench latency --input-len 128 --output-len 256 --batch-size 1 --preset W2
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from shoal.benchmarks.offline_common import add_common_flags, apply_preset, make_llm, record, save
from shoal.benchmarks.presets import LATENCY_PRESETS

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=None, help="default 32, or the preset's")
    p.add_argument("--output-len", type=int, default=None, help="default 128, or the preset's")
    p.add_argument("--batch-size", type=int, default=None, help="default 8, or the preset's")
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--num-iters-warmup", type=int, default=10)
    p.add_argument("--num-iters", type=int, default=30)
    add_common_flags(p, LATENCY_PRESETS)


def run(ns: argparse.Namespace) -> dict[str, Any]:
    from shoal.sampling_params import SamplingParams

    preset = apply_preset(ns, LATENCY_PRESETS)
    for name, default in (("input_len", 32), ("output_len", 128), ("batch_size", 8)):
        if getattr(ns, name) is None:
            setattr(ns, name, getattr(preset, name) if preset else default)
    if ns.num_iters < 1:
        raise ValueError("--num-iters must be >= 1")
    llm = make_llm(ns)
    rng = np.random.default_rng(ns.seed)
    prompts = [{"prompt_token_ids": rng.integers(0, 10000, ns.input_len).tolist()}
               for _ in range(ns.batch_size)]
    params = SamplingParams(n=ns.n, temperature=ns.temperature, top_p=ns.top_p,
                            ignore_eos=True, max_tokens=ns.output_len)

    def once() -> tuple[float, list[Any]]:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, outs

    iters: Any = range(ns.num_iters_warmup)
    if not ns.disable_tqdm:
        from tqdm import tqdm

        iters = tqdm(iters, desc="warm-up")
    for _ in iters:
        once()
    latencies, ttfts = [], []
    iters = range(ns.num_iters)
    if not ns.disable_tqdm:
        from tqdm import tqdm

        iters = tqdm(iters, desc="timed")
    for _ in iters:
        elapsed, outs = once()
        latencies.append(elapsed)
        firsts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs
                  if o.metrics is not None and o.metrics.first_token_time is not None]
        if len(firsts) == len(outs):
            ttfts.append(max(firsts))
    lat = np.asarray(latencies)
    tokens = ns.batch_size * ns.n * ns.output_len
    figures: dict[str, Any] = {
        "avg_latency": float(lat.mean()), "latencies": latencies,
        "percentiles": {str(p): float(np.percentile(lat, p)) for p in PERCENTILES},
        "input_len": ns.input_len, "output_len": ns.output_len,
        "batch_size": ns.batch_size, "n": ns.n, "temperature": ns.temperature,
        "output_tokens_per_second": tokens / float(lat.mean()),
    }
    print(f"Avg latency: {figures['avg_latency']} seconds")
    for p in PERCENTILES:
        print(f"{p}% percentile latency: {figures['percentiles'][str(p)]} seconds")
    print(f"Output tokens/s: {figures['output_tokens_per_second']:.2f}")
    if ttfts and ns.output_len > 1:
        ttft = float(np.mean(ttfts))
        decode = ns.batch_size * ns.n * (ns.output_len - 1) / (float(lat.mean()) - ttft)
        figures |= {"avg_ttft": ttft, "decode_tokens_per_second": decode}
        print(f"Avg TTFT: {ttft * 1000:.2f} ms; decode: {decode:.2f} tokens/s "
              f"({decode / (ns.batch_size * ns.n):.2f} per sequence)")
    result = record(ns, "latency", figures)
    save(ns.output_json, result)
    return result


def main(ns: argparse.Namespace) -> int:
    run(ns)
    return 0
