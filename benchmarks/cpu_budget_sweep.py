"""The CPU token budget: TTFT against throughput for a burst of prompts (issue 17, item 4).

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_budget_sweep.py --budgets 256,512,1024,16384

A burst of W4's CPU requests (64 prompts of 256 random token ids, 64 output tokens, greedy,
ignore_eos) goes through one offline LLM once per budget, the budgets interleaved in a
shuffled order each round so that a busy neighbour slows every budget alike. Each run draws
new prompts (no prefix-cache hits between runs). Per run: mean / median / p99 TTFT (arrival
to first token), mean time per output token after the first, output tok/s of the burst, and
the cores everything else on the machine used meanwhile (it is shared)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import engine_internals
from bench_args import add_common, comma_ints
from cpu_quiet import MachineLoad
from results_file import provenance, write

REPO = Path(__file__).resolve().parents[1]


def burst(llm: Any, budget: int, prompts: int, prompt_len: int, out_len: int,
          seed: int) -> dict[str, Any]:
    from shoal import SamplingParams

    sched = engine_internals.core(llm, required=True).scheduler
    sched.config = dataclasses.replace(sched.config, max_num_batched_tokens=budget)
    rng = random.Random(seed)
    batch = [{"prompt_token_ids": [rng.randrange(49000) for _ in range(prompt_len)]}
             for _ in range(prompts)]
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    load = MachineLoad()
    t = time.perf_counter()
    outs = llm.generate(batch, sp, use_tqdm=False)
    wall = time.perf_counter() - t
    ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    ends = [o.metrics.finished_time - o.metrics.first_token_time for o in outs
            if o.metrics.finished_time is not None]
    res = {"budget": budget, "wall_s": round(wall, 2),
           "output_tok_s": round(prompts * out_len / wall, 1),
           "ttft_mean_s": round(statistics.mean(ttft), 2),
           "ttft_median_s": round(statistics.median(ttft), 2),
           "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 2),
           "ttft_first_s": round(ttft[0], 2),
           **load.result()}
    if ends:
        res["tpot_mean_ms"] = round(1e3 * statistics.mean(ends) / (out_len - 1), 1)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--budgets", type=comma_ints, default=[256, 512, 1024, 2048, 16384])
    add_common(ap, rounds=2, dtype="auto", out=REPO / "bench-work" / "cpu_budget_sweep.json")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--out-len", type=int, default=64)
    args = ap.parse_args()
    from shoal import LLM

    budgets = args.budgets
    # The engine is built with the largest budget; each run lowers the scheduler's.
    llm = LLM(dtype=args.dtype, max_model_len=2048, max_num_batched_tokens=max(budgets),
              max_num_seqs=args.prompts)
    runs = []
    order = random.Random(0)
    for r in range(args.rounds):
        for b in order.sample(budgets, len(budgets)):
            res = {"round": r, **burst(llm, b, args.prompts, args.prompt_len, args.out_len,
                                       seed=1000 * r + b)}
            print(json.dumps(res), flush=True)
            runs.append(res)
    llm.shutdown()
    summary = {}
    for b in budgets:
        mine = [x for x in runs if x["budget"] == b]
        summary[b] = {k: statistics.median(x[k] for x in mine)
                      for k in ("output_tok_s", "ttft_mean_s", "ttft_median_s", "ttft_p99_s",
                                "ttft_first_s", "other_cores")}
    out = {**provenance(),
           "workload": f"burst of {args.prompts} x {args.prompt_len} in / {args.out_len} out",
           "dtype": args.dtype, "runs": runs, "median_by_budget": summary}
    write(out, args.out, indent=1)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
