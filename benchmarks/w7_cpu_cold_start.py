"""W7 on the CPU: seconds from launching `shoal serve` (its defaults, the embedded SmolLM2) to a
200 on /v1/models, then the first request's TTFT over the steady-state TTFT (128 prompt tokens,
32 generated, streamed; every request a different prompt, so no prefix-cache hit flatters
the steady figure).

    .venv/bin/python benchmarks/w7_cpu_cold_start.py [--runs 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from host_info import cpu_model

REPO = Path(__file__).resolve().parents[1]
PORT = 8031
URL = f"http://127.0.0.1:{PORT}"
VOCAB_LIMIT = 49000


def streamed_ttft(serial: int) -> float:
    """Seconds to the first streamed chunk of a 128-token prompt unique to `serial`."""
    prompt = [(i + 1000 * serial) * 37 % VOCAB_LIMIT + 1 for i in range(128)]
    body = json.dumps({"prompt": prompt, "max_tokens": 32, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(URL + "/v1/completions", body,
                                 {"content-type": "application/json"})
    t = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=120) as resp:
        for line in resp:
            if first is None and line.startswith(b"data: "):
                first = time.perf_counter() - t
    if first is None:
        raise RuntimeError("the stream sent no data")
    return first


def one_run(serials: Iterator[int]) -> dict[str, float]:
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(REPO / ".venv" / "bin" / "shoal"), "serve", "--port", str(PORT)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                urllib.request.urlopen(URL + "/v1/models", timeout=1)
                break
            except OSError:
                if proc.poll() is not None:
                    raise RuntimeError(f"shoal serve exited with {proc.returncode}") from None
                time.sleep(0.02)
        ready = time.perf_counter() - t0
        first = streamed_ttft(next(serials))
        steady = statistics.median(streamed_ttft(next(serials)) for _ in range(5))
    finally:
        proc.terminate()
        proc.wait()
    return {"ready_s": round(ready, 2), "first_ttft_s": round(first, 3),
            "steady_ttft_s": round(steady, 3), "first_over_steady": round(first / steady, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    serials = iter(range(1, 1 << 30))
    runs = []
    for _ in range(args.runs):
        runs.append(one_run(serials))
        print(json.dumps(runs[-1]), flush=True)
    commit = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                     text=True).strip()
    result = {"workload": "W7 (CPU): shoal serve defaults, 128 in / 32 out streamed",
              "cpu": cpu_model(), "commit": commit,
              "date": dt.datetime.now().isoformat(timespec="seconds"), "runs": runs,
              "median_ready_s": statistics.median(r["ready_s"] for r in runs)}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
