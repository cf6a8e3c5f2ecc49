"""`shoal serve` with its defaults (the embedded SmolLM2) on this CPU, from launch:

    .venv/bin/python benchmarks/cpu_serve_start.py w7 [--runs 3] [--out FILE]
    .venv/bin/python benchmarks/cpu_serve_start.py under-load [--python PY] [--out FILE]

w7: seconds from launching `shoal serve` to a 200 on /v1/models, then the first request's
TTFT over the steady-state TTFT (128 prompt tokens, 32 generated, streamed; every request a
different prompt, so no prefix-cache hit flatters the steady figure), --runs times.
under-load (issue 17's load check): seconds to a healthy /health (what `make serve` waits
for), then a 32-token request timed idle (5 runs) and with one CPU-bound process beside the
server (5 runs)."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator

from bench_args import add_common
from results_file import cpu_model, provenance, write
from server_process import SHOAL_CLI, ServerProcess, free_port

VOCAB_LIMIT = 49000
STORY = {"prompt": "Write a short story about a lighthouse keeper.", "max_tokens": 32,
         "temperature": 0, "ignore_eos": True}


def post(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                  {"content-type": "application/json"})


def streamed_ttft(url: str, serial: int) -> float:
    """Seconds to the first streamed chunk of a 128-token prompt unique to `serial`."""
    prompt = [(i + 1000 * serial) * 37 % VOCAB_LIMIT + 1 for i in range(128)]
    req = post(url, {"prompt": prompt, "max_tokens": 32, "ignore_eos": True, "temperature": 0,
                     "stream": True})
    t = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            if first is None and line.startswith(b"data: "):
                first = time.perf_counter() - t
    if first is None:
        raise RuntimeError("the stream sent no data")
    return first


def w7_run(python: str, serials: Iterator[int]) -> dict[str, float]:
    port = free_port()
    with ServerProcess([python, *SHOAL_CLI, "serve", "--port", str(port)], port,
                       ready_path="/v1/models", poll_s=0.02) as server:
        first = streamed_ttft(server.url, next(serials))
        steady = statistics.median(streamed_ttft(server.url, next(serials)) for _ in range(5))
    return {"ready_s": round(server.ready_s, 2), "first_ttft_s": round(first, 3),
            "steady_ttft_s": round(steady, 3), "first_over_steady": round(first / steady, 2)}


def w7(args: argparse.Namespace) -> dict:
    serials = iter(range(1, 1 << 30))
    runs = []
    for _ in range(args.runs):
        runs.append(w7_run(args.python, serials))
        print(json.dumps(runs[-1]), flush=True)
    return {**provenance(), "workload": "W7 (CPU): shoal serve defaults, 128 in / 32 out streamed",
            "cpu": cpu_model(), "runs": runs,
            "median_ready_s": statistics.median(r["ready_s"] for r in runs)}


def under_load(args: argparse.Namespace) -> dict:
    def one_request(url: str) -> float:
        t = time.perf_counter()
        urllib.request.urlopen(post(url, STORY), timeout=120).read()
        return time.perf_counter() - t

    port = free_port()
    with ServerProcess([args.python, *SHOAL_CLI, "serve", "--port", str(port)], port,
                       poll_s=0.2) as server:
        one_request(server.url)  # warm
        idle = sorted(one_request(server.url) for _ in range(5))
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(2)
            loaded = sorted(one_request(server.url) for _ in range(5))
        finally:
            hog.kill()
            hog.wait()
    return {**provenance(), "workload": "shoal serve beside one CPU-bound process",
            "cpu": cpu_model(), "ready_s": round(server.ready_s, 2),
            "idle_s": [round(x, 3) for x in idle],
            "with_one_busy_process_s": [round(x, 3) for x in loaded],
            "median_ratio": round(loaded[2] / idle[2], 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("check", choices=["w7", "under-load"])
    add_common(p, out=None)
    p.add_argument("--runs", type=int, default=3, help="w7: server launches")
    p.add_argument("--python", default=sys.executable, help="the interpreter that serves")
    args = p.parse_args()
    result = (w7 if args.check == "w7" else under_load)(args)
    print(json.dumps({k: v for k, v in result.items() if k not in ("host", "versions")}))
    if args.out:
        write(result, args.out, indent=1)


if __name__ == "__main__":
    main()
