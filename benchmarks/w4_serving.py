"""W4 on the CPU: online serving (`shoal serve` + the W4 load client) vs offline `shoal.LLM`.

One command: start `shoal serve` (embedded SmolLM2-135M) on a free port, wait for /health, run
the serve client (shoal/benchmarks/serve.py) at each max concurrency over one request list
(random token ids, seed 0, request rate inf, ignore_eos), stop the server with SIGTERM
(exit 0 expected), then run the very same requests offline with `shoal.LLM` (same engine
args, all at once) in a subprocess, and report server / offline output tok/s.

    .venv/bin/python benchmarks/w4_serving.py                      # full W4 (CPU)
    .venv/bin/python benchmarks/w4_serving.py --num-requests 8 --concurrency 1,4   # smoke

The full run writes benchmarks/results/<date>-W4-cpu.json (records of another dtype already
there are kept); anything else writes bench-work/results/<date>-W4-cpu-smoke.json.
Prefix caching is off on both sides: every concurrency level sends the same prompts, and
with it on every level after the first would hit the KV of the one before.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import hashlib
import json
import logging
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_common import record, write
from host_info import cpu_model

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "bench-work"
# W4 on the CPU as defined in /work/shared/BENCHMARKS.md.
W4 = {"num_requests": 64, "input_len": 256, "output_len": 64, "seed": 0}
TOKEN_RANGE = (100, 10000)  # the serve client's default random-dataset ids, [low, high)
WARMUP_SEED = 1_000_003  # warm-up prompt, different from every measured one
MAX_MODEL_LEN = 2048
# 64 sequences x (256 + 64) tokens take 0.94 GB of KV at float32; 2 GiB leaves room to spare.
DEFAULT_KV_BYTES = 2 << 30
BAR_CONCURRENCY, RATIO_BAR = 16, 0.85
LATENCY_KEYS = [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2e")
                for s in ("mean", "median", "p99")]


# ---------------------------------------------------------------------------------------------
# Helpers


def cpu_hardware() -> str:
    return f"{cpu_model()}, {os.cpu_count()} cores"


def git_dirty() -> bool | None:
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return bool(out.strip())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def requests_digest(prompts: list[list[int]], output_len: int) -> str:
    """sha256 of the request list, computed on each side to prove both ran the same requests."""
    blob = json.dumps({"prompts": prompts, "output_len": output_len}, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def serve_flags(engine_args: dict[str, Any]) -> list[str]:
    """Engine args as `shoal serve` flags (booleans as --x / --no-x)."""
    flags: list[str] = []
    for name, value in engine_args.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            flags += [f"--{flag}", str(value)]
    return flags


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("shoal", "torch", "httpx", "uvicorn", "fastapi"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


def thread_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "MKL_", "SHOAL_"))}


# ---------------------------------------------------------------------------------------------
# Server side


class Server:
    """`shoal serve` as a subprocess, its output in a log file."""

    def __init__(self, engine_args: dict[str, Any], log_path: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        shoal_bin = Path(sys.executable).parent / "shoal"
        self.cmd = [str(shoal_bin), "serve", "--port", str(self.port),
                    "--disable-uvicorn-access-log", *serve_flags(engine_args)]
        self.log_path = log_path
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float) -> float:
        """Starts the server and waits for /health; returns the seconds it took."""
        import httpx

        print(f"[w4] server: {shlex.join(self.cmd)}", flush=True)
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT)
        while time.perf_counter() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before /health "
                                   f"answered\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"no /health within {timeout:.0f} s\n{self.log_tail()}")

    def stop(self, timeout: float = 90) -> int | None:
        """SIGTERM and wait; returns the exit code (None if it had to be killed)."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def scrape(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sums of the Prometheus samples named `names` (over all label sets)."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        for name in names:
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


COUNTERS = ("shoal:prefix_cache_hits_total", "shoal:num_preemptions_total")


async def run_level(base_url: str, prompts: list[list[int]], output_len: int,
                    concurrency: int) -> dict[str, Any]:
    """One serve-client run at a max concurrency, plus the server's counter deltas."""
    import httpx

    from shoal.benchmarks.serve import run_benchmark, summarize

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None, connect=30),
                                 limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        before = scrape((await client.get("/metrics")).text, COUNTERS)
        results, duration = await run_benchmark(client, model, prompts, output_len, concurrency)
        after = scrape((await client.get("/metrics")).text, COUNTERS)
    summary = summarize(results, duration)
    summary["model"] = model
    summary["exact_lengths"] = all(r.ok and r.prompt_tokens == len(p)
                                   and r.output_tokens == output_len
                                   for r, p in zip(results, prompts))
    summary["prefix_cache_hit_tokens"] = after[COUNTERS[0]] - before[COUNTERS[0]]
    summary["preemptions"] = after[COUNTERS[1]] - before[COUNTERS[1]]
    return summary


def run_server_levels(args: argparse.Namespace, engine_args: dict[str, Any],
                      prompts: list[list[int]], warmup: list[list[int]], run_dir: Path,
                      env: dict[str, str]) -> dict[str, Any]:
    server = Server(engine_args, run_dir / "server.log", env)
    levels: dict[int, dict[str, Any]] = {}
    errors: dict[int, str] = {}
    try:
        ready_s = server.start(args.timeout)
        print(f"[w4] server ready in {ready_s:.1f} s on port {server.port}", flush=True)
        asyncio.run(run_level(server.base_url, warmup, args.output_len, 1))  # untimed
        for c in args.concurrency:
            try:
                s = asyncio.run(asyncio.wait_for(
                    run_level(server.base_url, prompts, args.output_len, c), args.timeout))
            except Exception as e:  # a hung or broken level: report it, skip the rest
                errors[c] = f"{type(e).__name__}: {e}"
                print(f"[w4] concurrency {c} FAILED: {errors[c]}", flush=True)
                break
            levels[c] = s
            print(f"[w4] concurrency {c:>3}: {s['completed']}/{len(prompts)} ok, "
                  f"{s['output_throughput']:.1f} out tok/s, TTFT mean/median/p99 "
                  f"{s['mean_ttft_ms']:.0f}/{s['median_ttft_ms']:.0f}/{s['p99_ttft_ms']:.0f} ms,"
                  f" TPOT {s['mean_tpot_ms']:.0f}/{s['median_tpot_ms']:.0f}/"
                  f"{s['p99_tpot_ms']:.0f} ms, ITL {s['mean_itl_ms']:.0f}/"
                  f"{s['median_itl_ms']:.0f}/{s['p99_itl_ms']:.0f} ms", flush=True)
    finally:
        exit_code = server.stop()
    print(f"[w4] server stopped with SIGTERM: exit code {exit_code}", flush=True)
    if exit_code != 0:
        print(server.log_tail(), flush=True)
    return {"ready_s": ready_s, "exit_code": exit_code, "command": shlex.join(server.cmd),
            "levels": levels, "errors": errors}


# ---------------------------------------------------------------------------------------------
# Offline side (a subprocess running this file with --offline-worker)


def offline_worker(spec_path: Path, result_path: Path) -> int:
    import torch

    from shoal import LLM, SamplingParams

    spec = json.loads(spec_path.read_text())
    prompts: list[list[int]] = spec["prompts"]
    output_len: int = spec["output_len"]
    t0 = time.perf_counter()
    llm = LLM(**spec["engine_args"])
    ready_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in spec["warmup"]], sp, use_tqdm=False)
    batch = [{"prompt_token_ids": p} for p in prompts]
    t0 = time.perf_counter()
    outs = llm.generate(batch, sp, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ran = [list(o.prompt_token_ids) for o in outs]
    result = {
        "ready_s": ready_s, "elapsed_s": elapsed, "total_output_tokens": out_tokens,
        "output_tok_s": out_tokens / elapsed,
        "exact_lengths": ran == prompts and all(len(o.outputs[0].token_ids) == output_len
                                                for o in outs),
        "requests_sha256": requests_digest(ran, output_len),
        "torch_threads": torch.get_num_threads(),
    }
    result_path.write_text(json.dumps(result) + "\n")
    return 0


def run_offline(args: argparse.Namespace, spec_path: Path, run_dir: Path,
                env: dict[str, str]) -> dict[str, Any] | None:
    result_path = run_dir / "offline.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--offline-worker", str(spec_path),
           "--offline-result", str(result_path)]
    print(f"[w4] offline: {shlex.join(cmd)}", flush=True)
    try:
        rc = subprocess.run(cmd, cwd=REPO, env=env, timeout=args.timeout).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc != 0 or not result_path.exists():
        print(f"[w4] offline run FAILED (exit {rc})", flush=True)
        return None
    res = json.loads(result_path.read_text())
    res["command"] = shlex.join(cmd)
    print(f"[w4] offline: {res['total_output_tokens']} tokens in {res['elapsed_s']:.1f} s = "
          f"{res['output_tok_s']:.1f} out tok/s", flush=True)
    return res


# ---------------------------------------------------------------------------------------------
# Parent


def parse_concurrency(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return levels


def merge_write(records: list[dict[str, Any]], path: Path, dtype: str) -> None:
    """Writes `records`, keeping the W4 records of other dtypes already in `path`."""
    kept: list[dict[str, Any]] = []
    if path.exists():
        try:
            kept = [r for r in json.loads(path.read_text())
                    if not (r.get("workload") == "W4" and r.get("dtype") == dtype)]
        except (json.JSONDecodeError, AttributeError):
            kept = []
    write(kept + records, path)


def main_parent(args: argparse.Namespace) -> int:
    from shoal.benchmarks.serve import random_prompts

    full = (args.num_requests == W4["num_requests"] and args.input_len == W4["input_len"]
            and args.output_len == W4["output_len"] and args.seed == W4["seed"])
    today = dt.date.today().isoformat()
    out = args.out or (REPO / "benchmarks" / "results" / f"{today}-W4-cpu.json" if full
                       else WORK / "results" / f"{today}-W4-cpu-smoke.json")
    run_dir = WORK / "w4-runs" / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)

    engine_args: dict[str, Any] = {"dtype": args.dtype, "max_model_len": MAX_MODEL_LEN,
                                   "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
                                   "enable_prefix_caching": False}
    if args.max_num_seqs:
        engine_args["max_num_seqs"] = args.max_num_seqs
    # One request list for both sides: the serve client's own random dataset.
    prompts = random_prompts(args.num_requests, args.input_len, *TOKEN_RANGE, args.seed)
    warmup = random_prompts(1, args.input_len, *TOKEN_RANGE, WARMUP_SEED)
    digest = requests_digest(prompts, args.output_len)
    spec_path = run_dir / "requests.json"
    spec_path.write_text(json.dumps({"engine_args": engine_args, "prompts": prompts,
                                     "warmup": warmup, "output_len": args.output_len}) + "\n")
    env = dict(os.environ)
    if args.omp_threads:
        env["OMP_NUM_THREADS"] = str(args.omp_threads)
    logging.getLogger("httpx").setLevel(logging.WARNING)

    served = run_server_levels(args, engine_args, prompts, warmup, run_dir, env)
    offline = run_offline(args, spec_path, run_dir, env)
    off_tps = offline["output_tok_s"] if offline else None

    records: list[dict[str, Any]] = []
    for c, s in served["levels"].items():
        ratio = s["output_throughput"] / off_tps if off_tps else None
        rec = record(
            "W4" if full else "W4-smoke", "shoal",
            hardware=cpu_hardware(), git_dirty=git_dirty(),
            model="SmolLM2-135M-Instruct (embedded GGUF)", served_model=s["model"],
            dtype=args.dtype, concurrency=c, num_requests=args.num_requests,
            input_len=args.input_len, output_len=args.output_len, seed=args.seed,
            token_id_range=list(TOKEN_RANGE), request_rate="inf", ignore_eos=True,
            temperature=0.0, engine_args=engine_args,
            **{k: s[k] for k in LATENCY_KEYS},
            output_tok_s=s["output_throughput"], request_throughput=s["request_throughput"],
            duration_s=s["duration_s"], completed=s["completed"], failed=s["failed"],
            total_output_tokens=s["total_output_tokens"],
            offline_output_tok_s=off_tps, ratio=ratio,
            offline_elapsed_s=offline["elapsed_s"] if offline else None,
            offline_ready_s=offline["ready_s"] if offline else None,
            ratio_bar=RATIO_BAR if c == BAR_CONCURRENCY else None,
            meets_bar=(ratio >= RATIO_BAR if ratio is not None else None)
            if c == BAR_CONCURRENCY else None,
            requests_sha256=digest,
            requests_identical=bool(offline) and offline["requests_sha256"] == digest,
            exact_lengths=s["exact_lengths"] and bool(offline) and offline["exact_lengths"],
            prefix_cache_hit_tokens=s["prefix_cache_hit_tokens"], preemptions=s["preemptions"],
            server_ready_s=served["ready_s"], server_exit_code=served["exit_code"],
            server_command=served["command"],
            offline_command=offline["command"] if offline else None,
            errors=s.get("first_errors"), env=thread_env(), versions=versions())
        records.append(rec)

    for rec in records:
        ratio = f"{rec['ratio']:.3f}" if rec["ratio"] is not None else "n/a"
        bar = f" (bar >= {RATIO_BAR}: {'met' if rec['meets_bar'] else 'NOT met'})" \
            if rec["ratio_bar"] else ""
        print(f"[w4] concurrency {rec['concurrency']:>3}: server {rec['output_tok_s']:.1f} / "
              f"offline {off_tps or 0:.1f} out tok/s = {ratio}{bar}", flush=True)
    if full and args.out is None:
        merge_write(records, out, args.dtype)
    else:
        write(records, out)
    ok = (served["exit_code"] == 0 and offline is not None and not served["errors"]
          and all(r["failed"] == 0 and r["requests_identical"] and r["exact_lengths"]
                  for r in records))
    if not ok:
        print("[w4] FAILED: see the records (failed requests, exit code, lengths)", flush=True)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", type=parse_concurrency, default=[1, 16, 64],
                    help="comma list of max concurrencies (default 1,16,64)")
    ap.add_argument("--dtype", default="float32", help="server and offline dtype")
    ap.add_argument("--num-requests", type=int, default=W4["num_requests"],
                    help="fewer than 64 makes a smoke run (written under bench-work/)")
    ap.add_argument("--input-len", type=int, default=W4["input_len"])
    ap.add_argument("--output-len", type=int, default=W4["output_len"])
    ap.add_argument("--seed", type=int, default=W4["seed"])
    ap.add_argument("--kv-cache-memory-bytes", type=int, default=DEFAULT_KV_BYTES)
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="engine max_num_seqs (default: shoal's, 64 on the CPU)")
    ap.add_argument("--omp-threads", type=int, default=None,
                    help="OMP_NUM_THREADS for the server and offline processes")
    ap.add_argument("--timeout", type=float, default=3600,
                    help="seconds for server start, each concurrency level and the offline run")
    ap.add_argument("--out", type=Path, default=None, help="results file (overrides the default)")
    # Internal: the offline worker.
    ap.add_argument("--offline-worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--offline-result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.offline_worker:
        return offline_worker(args.offline_worker, args.offline_result)
    return main_parent(args)


if __name__ == "__main__":
    sys.exit(main())
