"""How many head passes W9's EAGLE-3 drafter runs (issue 38): the engine of
spec_decode_gpu.py --methods eagle3 (a random EAGLE-3 head, forced acceptance rates, k
drafts, greedy, async scheduling on), counting per rate and batch size the engine steps, the
head's mirror passes (a step's rows, kept rows caught up) and its draft passes (drafts 2..k;
draft 1 comes out of the mirror pass). A schedule-level count: the same on any device, so
the CPU's tiny model shows what a change of the draft budget does to the GPU's work.

    python benchmarks/eagle3_head_passes.py --out /tmp/passes.json          # CPU, tiny Llama
    python benchmarks/eagle3_head_passes.py --device cuda --model meta-llama/Llama-3.1-8B \
        --dtype bfloat16 --out /tmp/passes.json

Writes {"b<batch>_a<rate>": {"steps": n, "alone": n, "verify": n, "mirror": n, "draft": n}}
(alone: steps launched with no other step in flight, i.e. not pipelined; verify: steps
verifying drafts), per method with --methods eagle3,forced (forced: W9's free drafter, the
same budget and schedule without head passes; its rows say what the head's own passes and
the steps they keep from pipelining cost). Eager drafting only (the CPU; on a GPU with CUDA
graphs the graphed passes are not counted)."""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

import engine_internals
import offline_runs
import spec_methods
from bench_args import REQUIRED, add_common, comma_floats, comma_ints


def count_passes(llm: Any) -> dict[str, int]:
    """Counters the drafter and the runner bump from now on (steps, alone, verify, mirror,
    draft; a drafter without head passes leaves the last two at 0)."""
    core = engine_internals.core(llm, required=True)
    runner = core.runner
    drafter = runner.drafter
    counts = dict(steps=0, alone=0, verify=0, mirror=0, draft=0)
    proposing = [False]
    execute = runner.execute

    def counted_execute(sched: Any) -> Any:
        if not sched.is_empty:  # (the step itself is in the queue already)
            counts["steps"] += 1
            counts["alone"] += len(core.queue) <= 1
            counts["verify"] += sched.has_drafts
        return execute(sched)
    runner.execute = counted_execute
    if not hasattr(drafter, "_run_depth"):
        return counts
    run_depth, propose = drafter._run_depth, drafter._propose

    def counted_run_depth(*args: Any) -> Any:
        counts["draft" if proposing[0] else "mirror"] += 1
        return run_depth(*args)

    def counted_propose(*args: Any, **kw: Any) -> Any:
        proposing[0] = True
        try:
            return propose(*args, **kw)
        finally:
            proposing[0] = False
    drafter._run_depth, drafter._propose = counted_run_depth, counted_propose
    return counts


def run_method(llm: Any, method: str, args: Any, sp: Any) -> dict[str, dict[str, int]]:
    vocab = engine_internals.vocab_size(llm) or 500
    counts = count_passes(llm)
    result: dict[str, dict[str, int]] = {}
    for batch in args.batch_sizes:
        rng = random.Random(batch)
        prompts = [offline_runs.random_prompt(rng, args.input_len, vocab, lo=100)
                   for _ in range(batch)]
        for rate in args.rates:
            spec_methods.set_rate(llm, method, rate)
            for key in counts:
                counts[key] = 0
            llm.generate(prompts, sp, use_tqdm=False)
            result[f"b{batch}_a{rate}"] = dict(counts)
            print(f"{method} batch {batch} rate {rate}: {counts}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common(p, out=REQUIRED, model=None, load_format="dummy", dtype="float32", repeats=1,
               device="cpu", smoke=None)
    p.add_argument("--batch-sizes", type=comma_ints, default=[1, 32])
    p.add_argument("--rates", type=comma_floats, default=[0.0, 0.5, 0.8, 1.0])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--methods", default="eagle3", help="comma list of eagle3, forced")
    args = p.parse_args(argv)
    if args.model is None:
        args.model = offline_runs.tiny_llama(Path(tempfile.mkdtemp(prefix="e3-passes-")))
    from shoal import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    result: dict[str, Any] = {}
    for method in args.methods.split(","):
        kw = spec_methods.engine_kwargs(args, method)
        kw["async_scheduling"] = True
        llm = offline_runs.start_engine(args.model, **kw).llm
        result[method] = run_method(llm, method, args, sp)
        del llm
    if list(result) == ["eagle3"]:  # the layout of the earlier result files
        result = result["eagle3"]
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
