"""Pipeline-parallel micro-batching on the CPU (issue 13, item 3): W6-like offline throughput
of the embedded SmolLM2 with pipeline_parallel_size=2, micro-batched against one step at a
time.

    PYTHONPATH=. .venv/bin/python benchmarks/pp_microbatch_cpu.py \\
        --configs pp2,pp2-serial,pp1 --rounds 2 --out benchmarks/results/X.json

A batch of random-token prompts (32 x 128 in, 64 out, greedy, ignore_eos) goes through one
offline LLM per configuration, each in its own subprocess, the configurations interleaved
round by round so that a busy neighbour slows them alike:
  pp2         pipeline_parallel_size=2 (mp executor, 1 torch thread per process), micro-batched
  pp2-serial  the same engine with its batch queue and scheduler cap turned off after start-up:
              one step in flight, as before micro-batching
  pp1         one process with the machine's torch threads, for reference
Per run: output tok/s of the batch (after a small warm-up batch), a hash of its tokens (the
same in every configuration: greedy), and the cores everything else on the machine used meanwhile (each run
waits for a quiet machine first)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import engine_internals
from bench_args import add_common
from cpu_quiet import MachineLoad, quiet
from results_file import provenance, write

REPO = Path(__file__).resolve().parents[1]


def _prompts(n: int, length: int, seed: int) -> list[dict[str, Any]]:
    import random

    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(49000) for _ in range(length)]}
            for _ in range(n)]


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from shoal import LLM, SamplingParams

    pp = 1 if args.worker == "pp1" else 2
    llm = LLM(pipeline_parallel_size=pp, max_model_len=512)
    core = engine_internals.core(llm, required=True)
    if args.worker == "pp2-serial":  # the engine before micro-batching: one step at a time
        core.batch_queue = None
        core.scheduler.micro_batches = 1
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    try:
        llm.generate(_prompts(4, 32, seed=1), sp, use_tqdm=False)  # warm-up
        t = time.perf_counter()
        outs = llm.generate(_prompts(args.num_requests, args.input_len, args.seed), sp,
                            use_tqdm=False)
        wall = time.perf_counter() - t
    finally:
        llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n_out = sum(map(len, tokens))
    return {"config": args.worker, "wall_s": round(wall, 2),
            "output_tok_s": round(n_out / wall, 1), "output_tokens": n_out,
            "torch_threads_engine_process": torch.get_num_threads(),
            "tokens_sha1": hashlib.sha1(json.dumps(tokens).encode()).hexdigest()}


def run_one(config: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", config, "--num-requests",
           str(args.num_requests), "--input-len", str(args.input_len), "--output-len",
           str(args.output_len), "--seed", str(args.seed)]
    waited = quiet(max_cores=0.15, limit=args.quiet_limit)  # the machine is shared
    load = MachineLoad()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    if proc.returncode != 0:
        raise RuntimeError(f"{config} failed:\n{proc.stderr[-4000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res.update(load.result())  # over the whole subprocess, start-up included
    res["waited_for_quiet_s"] = round(waited, 1)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--configs", default="pp2,pp2-serial,pp1")
    add_common(ap, rounds=2, num_requests=32, seed=0, out=None)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--quiet-limit", type=float, default=600.0,
                    help="seconds to wait for a quiet machine before each run")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args)), flush=True)
        return 0
    runs = []
    for r in range(args.rounds):
        for config in args.configs.split(","):
            res = {"round": r, **run_one(config, args)}
            print(json.dumps(res), flush=True)
            runs.append(res)
    summary = {
        **provenance(),
        "workload": {"model": "SmolLM2-135M-Instruct (embedded GGUF, float32)",
                     "num_requests": args.num_requests, "input_len": args.input_len,
                     "output_len": args.output_len, "temperature": 0, "ignore_eos": True,
                     "max_model_len": 512},
        "hardware": {"cores": os.cpu_count()},
        "runs": runs,
        "same_tokens": len({r["tokens_sha1"] for r in runs}) == 1,
        "best_output_tok_s": {c: max(r["output_tok_s"] for r in runs if r["config"] == c)
                              for c in args.configs.split(",")},
    }
    if args.out is not None:
        write(summary, args.out)
    print(json.dumps(summary["best_output_tok_s"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
