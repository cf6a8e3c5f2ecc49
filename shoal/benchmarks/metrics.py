"""Benchmark figures from per-request timings, with vLLM's definitions and JSON keys.

- TTFT: send to first token event; ITL: between token events (all requests pooled);
  E2EL: send to last token event; TPOT per request: (E2EL - TTFT) / (output tokens - 1),
  for requests with more than one output token.
- mean / median / std (population) and the chosen percentiles, numpy's linear
  interpolation, in milliseconds, under `mean_ttft_ms`, `p99_itl_ms`, ... (`p99.9_itl_ms`
  for a fractional percentile).
- throughputs divide by the benchmark's wall time; goodput counts the requests that met
  every SLO given (`--goodput ttft:200 tpot:50 e2el:5000`, in ms).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from shoal.benchmarks.request_funcs import RequestOutput

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": ("TTFT", "Time to First Token"),
                 "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
                 "itl": ("ITL", "Inter-token Latency"),
                 "e2el": ("E2EL", "End-to-end Latency")}


def percentile_key(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--goodput takes ttft|tpot|e2el:MILLISECONDS pairs, got {pair!r}")
        slos[name] = float(value)
        if slos[name] < 0:
            raise ValueError(f"--goodput {pair!r}: the SLO must be >= 0")
    return slos


def output_len(out: RequestOutput, tokenizer: Any = None) -> int:
    """The server's count; else the tokenizer's count of the text; else the events."""
    if out.output_tokens:
        return out.output_tokens
    if tokenizer is not None and out.generated_text:
        return len(tokenizer.encode(out.generated_text, add_special_tokens=False))
    return out.chunks


def stats_ms(values: Sequence[float], name: str, percentiles: Sequence[float]
             ) -> dict[str, float]:
    arr = np.asarray(values if len(values) else [0.0], dtype=np.float64) * 1000.0
    res = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        res[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return res


def tokens_over_time(outputs: Sequence[RequestOutput], lens: Sequence[int], bucket_s: float = 1.0
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens and running requests per time bucket from the first send. A request's
    tokens are spread over its token events (an event carrying several tokens counts them
    all at its time)."""
    ok = [(o, n) for o, n in zip(outputs, lens) if o.success]
    if not ok:
        return np.zeros(0), np.zeros(0)
    t0 = min(o.start_time for o, _ in ok)
    end = max(o.start_time + o.latency for o, _ in ok)
    nb = int(np.ceil((end - t0) / bucket_s)) + 1
    tokens = np.zeros(nb)
    running = np.zeros(nb)
    for o, n in ok:
        times = o.start_time - t0 + o.ttft + np.concatenate([[0.0], np.cumsum(o.itl)])
        per_event = np.full(len(times), n / len(times))
        np.add.at(tokens, np.minimum((times / bucket_s).astype(int), nb - 1), per_event)
        first = int((o.start_time - t0) / bucket_s)
        last = int((o.start_time - t0 + o.latency) / bucket_s)
        running[first:last + 1] += 1
    return tokens / bucket_s, running


def peak_concurrency(outputs: Sequence[RequestOutput]) -> int:
    events = sorted([(o.start_time, 1) for o in outputs if o.success]
                    + [(o.start_time + o.latency, -1) for o in outputs if o.success])
    peak = cur = 0
    for _, d in events:  # at equal times -1 sorts first: [start, end) intervals
        cur += d
        peak = max(peak, cur)
    return peak


def calculate_metrics(outputs: Sequence[RequestOutput], duration_s: float,
                      percentiles: Sequence[float] = (99,),
                      goodput: dict[str, float] | None = None,
                      tokenizer: Any = None) -> dict[str, Any]:
    """Everything vLLM's summary holds, keyed as in its result JSON."""
    lens = [output_len(o, tokenizer) if o.success else 0 for o in outputs]
    ok = [(o, n) for o, n in zip(outputs, lens) if o.success]
    ttfts = [o.ttft for o, _ in ok]
    e2els = [o.latency for o, _ in ok]
    itls = [x for o, _ in ok for x in o.itl]
    tpots = [(o.latency - o.ttft) / (n - 1) for o, n in ok if n > 1]
    total_in = sum(o.prompt_len for o, _ in ok)
    total_out = sum(lens)
    completed = len(ok)
    good = None
    if goodput:
        good = 0
        for o, n in ok:
            tpot = (o.latency - o.ttft) / (n - 1) if n > 1 else 0.0
            value = {"ttft": o.ttft, "tpot": tpot, "e2el": o.latency}
            good += all(value[k] * 1000 <= slo for k, slo in goodput.items())
    per_s, _ = tokens_over_time(outputs, lens)
    res: dict[str, Any] = {
        "duration": duration_s,
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": completed / duration_s if duration_s else 0.0,
        "request_goodput": (good / duration_s if duration_s else 0.0) if good is not None
        else None,
        "output_throughput": total_out / duration_s if duration_s else 0.0,
        "total_token_throughput": (total_in + total_out) / duration_s if duration_s else 0.0,
        "max_output_tokens_per_s": float(per_s.max()) if len(per_s) else 0.0,
        "max_concurrent_requests": peak_concurrency(outputs),
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        res |= stats_ms(values, name, percentiles)
    # Per-request arrays, in request order (vLLM writes them with --save-detailed).
    res |= {
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "queue_times": [o.client_queue_time for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }
    return res


DETAIL_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts",
               "errors")


def summary_lines(res: dict[str, Any], metrics: Sequence[str], percentiles: Sequence[float],
                  max_concurrency: int | None, request_rate: float,
                  goodput: bool) -> list[str]:
    """vLLM's summary table, line by line."""
    def row(label: str, value: Any) -> str:
        if isinstance(value, float):
            return f"{label:<40} {value:<10.2f}"
        return f"{label:<40} {value:<10}"

    lines = ["{:=^50}".format(" Serving Benchmark Result "),
             row("Successful requests:", res["completed"]),
             row("Failed requests:", res["failed"])]
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(row("Request rate configured (RPS):", float(request_rate)))
    lines += [row("Benchmark duration (s):", float(res["duration"])),
              row("Total input tokens:", res["total_input_tokens"]),
              row("Total generated tokens:", res["total_output_tokens"]),
              row("Request throughput (req/s):", float(res["request_throughput"]))]
    if goodput:
        lines.append(row("Request goodput (req/s):", float(res["request_goodput"])))
    lines += [row("Output token throughput (tok/s):", float(res["output_throughput"])),
              row("Peak output token throughput (tok/s):",
                  float(res["max_output_tokens_per_s"])),
              row("Peak concurrent requests:", float(res["max_concurrent_requests"])),
              row("Total token throughput (tok/s):", float(res["total_token_throughput"]))]
    for name in METRICS:
        if name not in metrics:
            continue
        short, title = METRIC_TITLES[name]
        lines.append(f"{title:-^50}")
        lines.append(row(f"Mean {short} (ms):", float(res[f"mean_{name}_ms"])))
        lines.append(row(f"Median {short} (ms):", float(res[f"median_{name}_ms"])))
        for p in percentiles:
            lines.append(row(f"P{percentile_key(p)} {short} (ms):",
                             float(res[f"p{percentile_key(p)}_{name}_ms"])))
    lines.append("=" * 50)
    return lines
