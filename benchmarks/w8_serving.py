"""W8, serving at engine speed (../shared/BENCHMARKS.md), in one run: the W1 requests offline
through `shoal bench throughput --preset W8` (--offline-runs in one process: the first full
batch against the next), then the same requests through `shoal serve` on the same folder and
engine arguments from 256 concurrent clients over --client-processes processes (`shoal bench
serve --preset W8`): streaming --stream-runs times (the first batch after ready, then
steady), then non-streaming. The figure: served output tok/s over the best offline run.

    python benchmarks/w8_serving.py --model bench-work/qwen3-0.6b-smol --out $OUT/w8.json
    python benchmarks/w8_serving.py --model bench-work/qwen3-0.6b-smol --step-trace \
        --stream-runs 3 --batch1-model meta-llama/Llama-3.1-8B --out $OUT/w8.json
    python benchmarks/w8_serving.py --model bench-work/qwen3-0.6b-smol --smoke --out /tmp/w8.json

MODEL: the Qwen3-0.6B shape with SmolLM2's vocabulary and tokenizer, so text comes back
(`export_hf_folder.py --shape qwen3-0.6b`), random bf16 weights, prefix caching off.
--step-trace: the engine core's per-step trace (SHOAL_STEP_TRACE) beside the per-request
timings (--save-detailed), to line the first served batch up with later ones.
--batch1-model: batch-1 streaming over HTTP too (128 in / 256 out, 6 requests one at a time),
whose inter-token latency compares with gpu_suite.py w2's offline decode step (or
hybrid_gpu.py batch1's); --batch1-only runs that alone, without the W8 sweep (with --smoke
and no --batch1-model: the smoke model).
--smoke: a 2-layer model with MODEL's tokenizer on the CPU, 8 short requests.
--api-server-count N: `shoal serve --api-server-count N` (N API processes over one engine).
--concurrency C: C streaming clients instead of the preset's 256; above 256, C requests on both
sides (so every client has one) and, unless --max-num-seqs is given, max_num_seqs C on both:

    python benchmarks/w8_serving.py --model bench-work/qwen3-0.6b-smol --api-server-count 4 \
        --concurrency 1024 --client-processes 8 --out $OUT/w8-1024.json
Only the CLI (`shoal serve`, `shoal bench`) is used, so any tree runs it; every command's
output and JSON stays in --work-dir (default: beside --out)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_args import REQUIRED, add_common
from offline_runs import tiny_llama
from results_file import record, write
from server_process import SHOAL_CLI, ServerProcess, free_port

ORDINALS = ("first", "second", "third", "fourth", "fifth")
W8_CONCURRENCY = W8_PROMPTS = 256  # the preset's clients and requests
SMOKE_REQUESTS = ["--random-input-len", "16", "--random-output-len", "8", "--token-id-prompts",
                  "--num-prompts", "8"]
RUN_KEYS = ("completed", "failed", "duration", "total_output_tokens", "output_throughput",
            "mean_ttft_ms", "median_ttft_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
            "mean_tpot_ms")


class W8:
    def __init__(self, args: argparse.Namespace):
        self.args, self.work = args, args.work_dir
        self.work.mkdir(parents=True, exist_ok=True)
        self.engine = ["--load-format", "dummy", "--dtype", "bfloat16"]
        self.requests = ["--preset", "W8"]
        # (serve's alone: clients at once)
        self.clients = (["--max-concurrency", str(args.concurrency)]
                        if args.concurrency != W8_CONCURRENCY else [])
        if args.concurrency > W8_PROMPTS:
            self.requests += ["--num-prompts", str(args.concurrency)]
        if args.max_num_seqs:
            self.engine += ["--max-num-seqs", str(args.max_num_seqs)]
        if args.smoke:
            self.engine = ["--load-format", "dummy", "--dtype", "float32", "--device", "cpu",
                           "--kv-cache-memory-bytes", str(256 << 20)]
            self.requests = SMOKE_REQUESTS
        self.commands: list[str] = []

    def cli(self, name: str, argv: list[str], timeout: float) -> None:
        """`shoal ARGV`, its output in <work>/<name>.log; fails on a non-zero exit."""
        self.commands.append(" ".join(["shoal", *argv]))
        with (self.work / f"{name}.log").open("w") as log:
            done = subprocess.run([sys.executable, *SHOAL_CLI, *argv], stdout=log,
                                  stderr=subprocess.STDOUT, timeout=timeout)
        if done.returncode != 0:
            tail = (self.work / f"{name}.log").read_text()[-2000:]
            raise RuntimeError(f"shoal {argv[:2]} exited {done.returncode}:\n{tail}")

    def offline(self) -> dict[str, Any]:
        out = self.work / "offline.json"
        self.cli("offline", ["bench", "throughput", *self.requests, "--model", self.args.model,
                             "--tokenizer", self.args.model, *self.engine,
                             "--no-enable-prefix-caching", "--num-runs",
                             str(self.args.offline_runs), "--disable-tqdm", "--output-json",
                             str(out)], self.args.timeout)
        return json.loads(out.read_text())

    def serve(self, model: str, extra: list[str], env: dict[str, str]) -> ServerProcess:
        port = free_port()
        cmd = [sys.executable, *SHOAL_CLI, "serve", model, *self.engine, "--port", str(port),
               "--disable-uvicorn-access-log", *extra]
        self.commands.append(" ".join(["shoal", *cmd[3:]]))
        return ServerProcess(cmd, port, env=env, log=self.work / f"server-{port}.log",
                             timeout=self.args.timeout, poll_s=0.5)

    def bench_serve(self, server: ServerProcess, name: str, argv: list[str]) -> dict[str, Any]:
        self.cli(name, ["bench", "serve", "--port", str(server.port), "--tokenizer",
                        self.args.model, "--disable-tqdm", "--save-result", "--result-dir",
                        str(self.work), "--result-filename", f"{name}.json", *argv],
                 self.args.timeout)
        res = json.loads((self.work / f"{name}.json").read_text())
        return {k: res.get(k) for k in RUN_KEYS}

    def served(self) -> tuple[dict[str, dict], float]:
        env = dict(os.environ)
        if self.args.step_trace:
            env["SHOAL_STEP_TRACE"] = str(self.work / "step-trace.jsonl")
        clients = ["--num-client-processes", str(self.args.client_processes), *self.clients]
        detailed = ["--save-detailed"] if self.args.step_trace else []
        runs, self.marks = {}, []  # marks: monotonic time before each run (the trace's clock)
        pool = ["--api-server-count", str(self.args.api_server_count)]
        with self.serve(self.args.model, ["--no-enable-prefix-caching", *pool], env) as server:
            for i in range(self.args.stream_runs):
                self.marks.append(time.monotonic())
                runs[f"stream_{ORDINALS[i]}"] = self.bench_serve(
                    server, f"serve-stream-{i + 1}", [*self.requests, *clients, *detailed])
            self.marks.append(time.monotonic())
            runs["nonstream"] = self.bench_serve(
                server, "serve-nonstream", [*self.requests, *clients, *detailed,
                                            "--non-streaming"])
        self.marks.append(time.monotonic())
        return runs, server.ready_s

    def step_trace(self, files: list[str]) -> dict[str, dict[str, float]]:
        """Per run, the engine core's steps between its mark and the next (step_trace.py);
        the client's first send is its earliest start time (perf_counter: the same clock)."""
        lines = (self.work / "step-trace.jsonl").read_text().splitlines()
        steps = [json.loads(line) for line in lines if line.strip()]
        out = {}
        for name, t0, t1 in zip(files, self.marks, self.marks[1:]):
            mine = [s for s in steps if t0 <= s["t"] < t1 and s["tokens"]]
            sent = min(json.loads((self.work / f"{name}.json").read_text())["start_times"])
            if mine:
                out[name.removeprefix("serve-")] = {
                    "steps": len(mine),
                    "engine_first_add_to_last_step_s": round(
                        mine[-1]["t"] + mine[-1]["step_ms"] / 1e3 - mine[0]["t"], 3),
                    "first_send_to_engine_first_add_ms": round(1e3 * (mine[0]["t"] - sent), 1),
                    **{f"{k}_ms": round(f(s[f"{k.split('_')[-1]}_ms"] for s in mine), 1)
                       for k, f in (("max_step", max), ("sum_step", sum), ("sum_send", sum),
                                    ("sum_drain", sum))}}
        return out

    def batch1_http(self) -> dict[str, Any]:
        with self.serve(self.args.batch1_model, ["--tokenizer", self.args.model,
                                                 "--max-model-len", "4096",
                                                 "--max-num-seqs", "16"],
                        dict(os.environ)) as server:
            run = self.bench_serve(server, "batch1-serve-stream", [
                "--dataset-name", "random", "--random-input-len", "128",
                "--random-output-len", "256", "--token-id-prompts", "--ignore-eos",
                "--temperature", "0", "--num-prompts", "6", "--num-warmups", "1",
                "--max-concurrency", "1"])
        return {"batch1_model": self.args.batch1_model, "batch1_server_ready_s": server.ready_s,
                "batch1_http_mean_itl_ms": run["mean_itl_ms"],
                "batch1_http_median_itl_ms": run["median_itl_ms"],
                "batch1_http_mean_ttft_ms": run["mean_ttft_ms"]}


def smoke_model(model: str) -> str:
    """A 2-layer Llama with MODEL's tokenizer files and vocabulary, in a temp folder."""
    folder = Path(tempfile.mkdtemp(prefix="w8-smoke-"))
    for f in Path(model).iterdir():
        if f.name != "config.json" and f.is_file():
            shutil.copy(f, folder / f.name)
    cfg = json.loads(Path(model, "config.json").read_text())
    return tiny_llama(folder, vocab=cfg["vocab_size"], eos=cfg.get("eos_token_id", 2))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common(p, out=REQUIRED, model=REQUIRED, smoke="a 2-layer model on the CPU, 8 requests")
    p.add_argument("--work-dir", type=Path, default=None,
                   help="logs and per-run JSON (default: <out without .json>-runs/)")
    p.add_argument("--offline-runs", type=int, default=2)
    p.add_argument("--stream-runs", type=int, default=2)
    p.add_argument("--client-processes", type=int, default=4,
                   help="client processes of `bench serve` (one keeps up to ~40k tok/s)")
    p.add_argument("--step-trace", action="store_true")
    p.add_argument("--api-server-count", type=int, default=1,
                   help="API server processes of `shoal serve` (one engine core)")
    p.add_argument("--concurrency", type=int, default=W8_CONCURRENCY,
                   help="streaming clients at once (1..1024; default: the preset's 256)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="the engine's batch limit, both sides (default: the engine's, or "
                        "--concurrency above 256)")
    p.add_argument("--batch1-model", default=None)
    p.add_argument("--batch1-only", action="store_true",
                   help="only --batch1-model's batch-1 streaming over HTTP (no W8 sweep)")
    p.add_argument("--timeout", type=float, default=240, help="seconds per command")
    args = p.parse_args()
    if not 1 <= args.concurrency <= 1024:
        p.error(f"--concurrency must be in 1..1024 (got {args.concurrency})")
    if not 1 <= args.api_server_count <= 64:
        p.error(f"--api-server-count must be in 1..64 (got {args.api_server_count})")
    if args.max_num_seqs is None and args.concurrency > W8_PROMPTS and not args.smoke:
        args.max_num_seqs = args.concurrency
    args.work_dir = args.work_dir or args.out.with_name(args.out.stem + "-runs")
    args.model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    if args.batch1_only and not (args.batch1_model or args.smoke):
        p.error("--batch1-only needs --batch1-model")
    if args.smoke:
        args.model, args.client_processes = smoke_model(args.model), 1
        if args.batch1_only and not args.batch1_model:
            args.batch1_model = args.model
    w8 = W8(args)
    if args.batch1_only:
        figures = {"model": args.model, "smoke": args.smoke, **w8.batch1_http(),
                   "commands": w8.commands}  # (the served engine's arguments: its command)
        write([record("W8 batch1 serve", "shoal", **figures)], args.out)
        print(json.dumps(figures, indent=1))
        return 0
    offline = w8.offline()
    offline_tok_s = [r["output_tokens_per_second"] for r in offline["runs"]]
    served, ready = w8.served()
    best = max(offline_tok_s)
    streams = [r["output_throughput"] for k, r in served.items() if k.startswith("stream")]
    figures: dict[str, Any] = {
        "model": args.model, "smoke": args.smoke, "requests": " ".join(w8.requests),
        "engine_args": " ".join(w8.engine) + " --no-enable-prefix-caching (both sides)",
        "offline_output_tok_s": offline_tok_s, "serve_stream_output_tok_s": streams,
        "serve_nonstream_output_tok_s": served["nonstream"]["output_throughput"],
        "serve_over_best_offline": {k: r["output_throughput"] / best for k, r in served.items()},
        "serve_stream_first_over_second": streams[0] / streams[1] if len(streams) > 1 else None,
        "completed": [r["completed"] for r in served.values()],
        "total_output_tokens": [r["total_output_tokens"] for r in served.values()],
        "offline_total_output_tokens": offline["total_output_tokens"],
        "serve_ready_s": ready, "serve_runs": served,
        "client_processes": args.client_processes, "work_dir": str(args.work_dir),
        "api_server_count": args.api_server_count, "concurrency": args.concurrency,
        "max_num_seqs": args.max_num_seqs}
    if args.step_trace:
        figures["step_trace"] = w8.step_trace(
            [f"serve-stream-{i + 1}" for i in range(args.stream_runs)] + ["serve-nonstream"])
    if args.batch1_model:
        figures |= w8.batch1_http()
    figures["commands"] = w8.commands
    write([record("W8", "shoal", **figures)], args.out)
    print(json.dumps(figures["serve_over_best_offline"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
