"""Issue 17's load check: `shoal serve` with its defaults on this machine, a 32-token request
timed idle (5 runs) and with one CPU-bound process beside it (5 runs), plus the seconds from
process start to a healthy /health (what `make serve` waits for after install).

    .venv/bin/python benchmarks/cpu_serve_under_load.py [PYTHON]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

PORT = 8141
URL = f"http://127.0.0.1:{PORT}"
BODY = json.dumps({"prompt": "Write a short story about a lighthouse keeper.",
                   "max_tokens": 32, "temperature": 0, "ignore_eos": True}).encode()


def wait_healthy() -> None:
    while True:
        try:
            urllib.request.urlopen(URL + "/health", timeout=1)
            return
        except OSError:
            time.sleep(0.2)


def one_request() -> float:
    t = time.perf_counter()
    req = urllib.request.Request(URL + "/v1/completions", BODY,
                                 {"content-type": "application/json"})
    urllib.request.urlopen(req, timeout=120).read()
    return time.perf_counter() - t


def main() -> None:
    python = sys.argv[1] if len(sys.argv) > 1 else sys.executable
    t0 = time.time()
    server = subprocess.Popen([python, "-m", "shoal.cli", "serve", "--port",
                               str(PORT)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_healthy()
        ready = time.time() - t0
        one_request()  # warm
        idle = sorted(one_request() for _ in range(5))
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(2)
            loaded = sorted(one_request() for _ in range(5))
        finally:
            hog.kill()
    finally:
        server.terminate()
        server.wait(30)
    print(json.dumps({"ready_s": round(ready, 2), "idle_s": [round(x, 3) for x in idle],
                      "with_one_busy_process_s": [round(x, 3) for x in loaded],
                      "median_ratio": round(loaded[2] / idle[2], 2)}))


if __name__ == "__main__":
    main()
