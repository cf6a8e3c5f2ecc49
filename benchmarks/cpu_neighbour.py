"""The CPU engine beside a busy neighbour (issue 39, item 4): W6 and batch-1 decode on the real
SmolLM2 model, float32 and bfloat16, offline (`LLM`) and served (`shoal serve`), each with and
without one other process running a pure-Python `while True: pass`.

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_neighbour.py                  # full W6
    PYTHONPATH=. .venv/bin/python benchmarks/cpu_neighbour.py --num-requests 8 \\
        --input-len 32,64 --output-len 16,32 --batch1-len 64,32                # smoke

Per dtype and mode one engine starts; then the phases run in turn, `--rounds` times each
(quiet, busy, quiet, busy, ...), each phase: batch-1 decode (as W6 measures it), then the W6
batch. A busy phase starts the neighbour process first and stops it after. The figures per
case: the median output tok/s and batch-1 decode tok/s of each condition and the slowdown
quiet / busy (the goal: at most 2.5 on a 2-core host), the cores other processes used in
each phase (the neighbour is one of them: a shared machine shows more), and for the offline
engine the seconds it spent at each model-thread count (shoal/engine/cpu_governor.py).
Offline runs in a worker subprocess, so the neighbour and this script are other processes
to it, as they are to the served engine. The result file names the CPU and its flags, and
what dtype="auto" picks there."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from bench_args import add_common, comma_words, int_range
from cpu_quiet import MachineLoad
from results_file import default_path, host, provenance, write
from served_decode import stream_completion
from server_process import SHOAL_CLI, ServerProcess, free_port
from w6_cpu_throughput import MAX_MODEL_LEN, W6, make_requests, parse_pair

REPO = Path(__file__).resolve().parents[1]
GOAL = 2.5  # slowest busy/quiet ratio the issue accepts on a 2-core host


class Neighbour:
    """One pure-Python busy loop in its own process, while the context is open."""

    def __init__(self, on: bool):
        self.on, self.proc = on, None

    def __enter__(self) -> Neighbour:
        if self.on:
            self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(0.5)  # running before the phase starts
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def phases(rounds: int) -> list[str]:
    return ["quiet", "busy"] * rounds


# ---------------------------------------------------------------------------------------------
# Offline: a worker subprocess with one LLM


def offline_worker(args: argparse.Namespace) -> int:
    import engine_internals
    from w6_cpu_throughput import Runner, run_batch1

    req = json.loads(Path(args.requests).read_text())
    runner = Runner("shoal", args.dtype, "")
    w = req["warmup"]
    runner.generate([(w["prompt_token_ids"], w["max_tokens"])])
    batch = list(zip(req["prompt_token_ids"], req["max_tokens"]))
    gov = getattr(engine_internals.core(runner.llm), "thread_governor", None)
    rows = []
    for phase in phases(args.rounds):
        before = dict(gov.seconds_at) if gov is not None else {}
        with Neighbour(phase == "busy"):
            load = MachineLoad()
            row = {"phase": phase, **run_batch1(runner, req)}
            t = time.perf_counter()
            outs = runner.generate(batch)
            wall = time.perf_counter() - t
            row.update(output_tok_s=sum(map(len, outs)) / wall, elapsed_s=wall, **load.result())
        if gov is not None:
            row["seconds_at_threads"] = {str(k): round(v - before.get(k, 0.0), 2)
                                         for k, v in gov.seconds_at.items()}
        import torch

        row["threads_after"] = torch.get_num_threads()
        rows.append(row)
        print(f"[neighbour] offline {args.dtype} {phase}: {row['output_tok_s']:.1f} out tok/s, "
              f"batch-1 {row['batch1_tok_s'] or 0:.1f} tok/s", flush=True)
    info = {"start_threads": gov.ceiling if gov is not None else None,
            "adaptive": gov is not None, "threads_changes": gov.changes if gov else 0}
    Path(args.result).write_text(json.dumps({"phases": rows, "engine": info}) + "\n")
    return 0


def run_offline(dtype: str, args: argparse.Namespace, req_path: Path, work: Path) -> dict:
    result = work / f"offline-{dtype}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--dtype", dtype,
           "--requests", str(req_path), "--result", str(result), "--rounds", str(args.rounds)]
    subprocess.run(cmd, cwd=REPO, check=True, timeout=args.timeout,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    return json.loads(result.read_text())


# ---------------------------------------------------------------------------------------------
# Served: `shoal serve` and HTTP clients from this process


def _post(url: str, body: dict[str, Any], timeout: float) -> dict[str, Any]:
    data = json.dumps(body).encode()
    rq = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(rq, timeout=timeout) as r:
        return json.loads(r.read())


MODEL = {"name": ""}  # the served model's name, from /v1/models


def _completion(ids: list[int], n: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL["name"], "prompt": ids, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, **extra}


def served_batch1(url: str, req: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One streaming request: decode tok/s = (tokens - 1) / (last chunk - first chunk)."""
    b1 = req["batch1"]
    r = stream_completion(url, MODEL["name"], b1["prompt_token_ids"], b1["max_tokens"], timeout)
    return {"batch1_tok_s": r["decode_tok_s"], "batch1_ttft_s": r["ttft_s"],
            "batch1_output_tokens": r["output_tokens"], "batch1_total_s": r["total_s"]}


def served_w6(url: str, req: dict[str, Any], timeout: float) -> dict[str, Any]:
    bodies = [_completion(ids, n) for ids, n in zip(req["prompt_token_ids"], req["max_tokens"])]
    t = time.perf_counter()
    with ThreadPoolExecutor(len(bodies)) as pool:
        outs = list(pool.map(lambda b: _post(url + "/v1/completions", b, timeout), bodies))
    wall = time.perf_counter() - t
    tokens = sum(o["usage"]["completion_tokens"] for o in outs)
    return {"output_tok_s": tokens / wall, "elapsed_s": wall, "total_output_tokens": tokens}


def run_served(dtype: str, args: argparse.Namespace, req: dict[str, Any], work: Path) -> dict:
    port = free_port()
    cmd = [sys.executable, *SHOAL_CLI, "serve", "--port", str(port), "--dtype", dtype,
           "--max-model-len", str(MAX_MODEL_LEN), "--disable-uvicorn-access-log"]
    rows = []
    with ServerProcess(cmd, port, cwd=REPO, log=work / f"serve-{dtype}.log",
                       env={**os.environ, "PYTHONPATH": str(REPO)}) as server:
        with urllib.request.urlopen(server.url + "/v1/models", timeout=30) as r:
            MODEL["name"] = json.loads(r.read())["data"][0]["id"]
        w = req["warmup"]
        _post(server.url + "/v1/completions",
              _completion(w["prompt_token_ids"], w["max_tokens"]), args.timeout)
        for phase in phases(args.rounds):
            with Neighbour(phase == "busy"):
                load = MachineLoad()
                row = {"phase": phase, **served_batch1(server.url, req, args.timeout),
                       **served_w6(server.url, req, args.timeout)}
                row.update(load.result())
            rows.append(row)
            print(f"[neighbour] served {dtype} {phase}: {row['output_tok_s']:.1f} out tok/s, "
                  f"batch-1 {row['batch1_tok_s'] or 0:.1f} tok/s", flush=True)
        ready_s = server.ready_s
    return {"phases": rows, "engine": {"ready_s": ready_s}}


# ---------------------------------------------------------------------------------------------
# Summary


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """Medians per condition and the slowdowns quiet / busy."""
    out: dict[str, Any] = {}
    for key in ("output_tok_s", "batch1_tok_s"):
        med = {}
        for cond in ("quiet", "busy"):
            vals = [r[key] for r in data["phases"] if r["phase"] == cond and r.get(key)]
            med[cond] = round(statistics.median(vals), 2) if vals else None
        out[f"{key}_quiet"], out[f"{key}_busy"] = med["quiet"], med["busy"]
        slow = med["quiet"] / med["busy"] if med["quiet"] and med["busy"] else None
        name = "w6" if key == "output_tok_s" else "batch1"
        out[f"{name}_slowdown_busy_over_quiet"] = round(slow, 2) if slow else None
        out[f"{name}_within_goal"] = slow is not None and slow <= GOAL
    return out


def cpu_description() -> dict[str, Any]:
    from shoal.config.cpu_dtype import choose_cpu_dtype, cpu_flags
    from shoal.engine.cpu_quota import cgroup_cpu_quota, usable_cores

    flags = cpu_flags()
    auto = choose_cpu_dtype(flags)
    return {**{k: v for k, v in host().items() if k in ("cpu", "cores", "isa_flags")},
            "usable_cores": usable_cores(), "cgroup_cpu_quota": cgroup_cpu_quota(),
            "auto_dtype": auto.name, "auto_dtype_reason": auto.reason,
            "flags": sorted(flags or ())}


def main_parent(args: argparse.Namespace) -> int:
    full = (args.num_requests == W6["num_requests"] and args.input_len == W6["input_len"]
            and args.output_len == W6["output_len"] and args.batch1_len == W6["batch1_len"])
    out = args.out or default_path("cpu-neighbour", "cpu", smoke=not full,
                                   suffix="" if full else "-smoke")
    work = REPO / "bench-work" / "cpu-neighbour" / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    req = make_requests(args.num_requests, args.seed, args.input_len, args.output_len,
                        args.batch1_len)
    req_path = work / "requests.json"
    req_path.write_text(json.dumps(req) + "\n")
    cases = []
    for dtype in args.dtypes:
        for mode in args.modes:
            print(f"[neighbour] {mode} {dtype}", flush=True)
            case: dict[str, Any] = {"mode": mode, "dtype": dtype}
            try:
                data = (run_offline(dtype, args, req_path, work) if mode == "offline"
                        else run_served(dtype, args, req, work))
            except (subprocess.SubprocessError, RuntimeError, OSError) as e:
                cases.append({**case, "error": f"{type(e).__name__}: {e}"})
                continue
            cases.append({**case, **summarize(data), **data})
            print(f"[neighbour] {mode} {dtype}: slowdown W6 "
                  f"{cases[-1]['w6_slowdown_busy_over_quiet']}, batch-1 "
                  f"{cases[-1]['batch1_slowdown_busy_over_quiet']}", flush=True)
    workload = {"id": "W6" if full else "W6-smoke", "model": "SmolLM2-135M-Instruct (GGUF Q4_1)",
                "num_requests": args.num_requests, "seed": args.seed,
                "input_len": list(args.input_len), "output_len": list(args.output_len),
                "batch1_len": list(args.batch1_len), "max_model_len": MAX_MODEL_LEN,
                "rounds": args.rounds, "neighbour": "one process: python -c 'while True: pass'",
                "goal": f"slowdown busy/quiet <= {GOAL} on a 2-core host"}
    write({**provenance(), "cpu": cpu_description(), "workload": workload,
           "env": {k: v for k, v in os.environ.items() if k.startswith(("SHOAL_", "OMP_"))},
           "cases": cases}, out)
    return 0 if all("error" not in c for c in cases) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_common(ap, num_requests=W6["num_requests"], seed=W6["seed"], out=None, rounds=1)
    ap.add_argument("--input-len", type=int_range, default=W6["input_len"], help="lo,hi")
    ap.add_argument("--output-len", type=int_range, default=W6["output_len"], help="lo,hi")
    ap.add_argument("--batch1-len", type=parse_pair, default=W6["batch1_len"],
                    help="input,output tokens of the batch-1 run")
    ap.add_argument("--dtypes", type=comma_words, default=["float32", "bfloat16"])
    ap.add_argument("--modes", type=comma_words, default=["offline", "served"])
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per engine")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--requests", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return offline_worker(args)
    bad = [m for m in args.modes if m not in ("offline", "served")]
    if bad:
        raise SystemExit(f"unknown mode(s) {bad}: offline, served")
    return main_parent(args)


if __name__ == "__main__":
    sys.exit(main())
