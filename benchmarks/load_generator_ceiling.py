"""How fast can `shoal bench serve` drive a server? Measured against the fake server.

The fake server (shoal/benchmarks/fake_server.py) answers with no model behind it, so what
limits the run is the client (and the fake server's own event loop). Two kinds of run, each
with 256 concurrent streams:

- unpaced: the server streams as fast as it can; the figure is the client's ceiling in
  streamed tokens per second (events then pile up and arrive several per socket read);
- paced: the server sleeps `--itl-ms` between tokens, as an engine step would, so each read
  holds about one event; the client keeps up when its output tok/s reaches
  streams / itl and the median ITL it measures stays at the server's.

    .venv/bin/python benchmarks/load_generator_ceiling.py                 # this machine
    python benchmarks/load_generator_ceiling.py --server-workers 4 --client-processes 1,2,4

Writes benchmarks/results/<date>-loadgen-ceiling-<host kind>.json (`--out` to choose).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench_args import comma_floats, comma_ints
from results_file import default_path, provenance, write
from server_process import ServerProcess, free_port

REPO = Path(__file__).resolve().parents[1]


def start_fake(port: int, itl_ms: float, workers: int) -> ServerProcess:
    cmd = [sys.executable, "-m", "shoal.benchmarks.fake_server", "--port", str(port),
           "--itl-ms", str(itl_ms), "--num-workers", str(workers)]
    return ServerProcess(cmd, port, cwd=REPO, timeout=60, poll_s=0.2)


def bench(port: int, n: int, tokens: int, conc: int, procs: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "shoal.benchmarks", "serve", "--base-url",
           f"http://127.0.0.1:{port}", "--skip-tokenizer-init", "--disable-tqdm",
           "--num-prompts", str(n), "--random-input-len", "16", "--random-output-len",
           str(tokens), "--max-concurrency", str(conc), "--num-client-processes", str(procs),
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", str(out.parent),
           "--result-filename", out.name]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stdout[-2000:] + done.stderr[-2000:])
    res = json.loads(out.read_text())
    return {"command": " ".join(["shoal bench", *cmd[3:]]),
            **{k: res[k] for k in ("completed", "failed", "duration", "total_output_tokens",
                                   "output_throughput", "median_itl_ms", "p99_itl_ms",
                                   "mean_ttft_ms", "max_concurrent_requests")}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=200)
    p.add_argument("--itl-ms", type=comma_floats, default="0,10,5",
                   help="server pacing per run; 0 = unpaced")
    p.add_argument("--client-processes", type=comma_ints, default="1")
    p.add_argument("--server-workers", type=int, default=1)
    p.add_argument("--hardware", default=None, help="name for the result file")
    p.add_argument("--out", type=Path, default=None)
    ns = p.parse_args()
    work = REPO / "bench-work" / "loadgen"
    work.mkdir(parents=True, exist_ok=True)
    hardware = ns.hardware or f"cpu{os.cpu_count()}"
    runs = []
    for itl in ns.itl_ms:
        port = free_port()
        server = start_fake(port, itl, ns.server_workers)
        try:
            for procs in ns.client_processes:
                r = bench(port, ns.num_prompts, ns.output_len, ns.concurrency, procs,
                          work / f"itl{itl}-p{procs}.json")
                r |= {"server_itl_ms": itl, "client_processes": procs,
                      "server_workers": ns.server_workers,
                      "paced_target_tok_s": ns.concurrency * 1000 / itl if itl else None}
                print(f"itl {itl} ms, {procs} client process(es): "
                      f"{r['output_throughput']:,.0f} tok/s, median ITL "
                      f"{r['median_itl_ms']:.2f} ms, p99 ITL {r['p99_itl_ms']:.2f} ms, "
                      f"completed {r['completed']}", flush=True)
                runs.append(r)
        finally:
            server.stop(timeout=30)
    record = {**provenance(), "what": "load generator ceiling against the fake OpenAI server",
              "hardware": hardware,
              "cpu_count": os.cpu_count(), "concurrency": ns.concurrency,
              "num_prompts": ns.num_prompts, "output_len": ns.output_len, "runs": runs}
    out = ns.out or default_path("loadgen-ceiling", hardware)
    write(record, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
