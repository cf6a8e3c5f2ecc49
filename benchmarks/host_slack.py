"""How much host work a pipelined decode step hides (issue 38): W9's plain engine (Llama-3.1-8B
shape, random bf16 weights, 128 input / 256 output tokens, greedy, async scheduling) with a
busy-wait of D microseconds added to every step's finish, where a drafter's work on a
pipelined step runs (its mirror; on_launch runs beside it, at the launch). Per batch size and
D: ms per step (median of --repeats runs). While D fits in the step's slack (the device time
of the step in flight minus the host's own loop) ms per step stays flat; once it does not,
it grows one for one. EAGLE-3 at forced acceptance 0 adds ~0.1 ms of host work a pipelined
step at batch 1 (on_launch, kept-row bookkeeping) and ~1-2 ms at each catch-up of kept rows:
with no slack those cost their whole host time, with enough they cost only device time.

    python benchmarks/host_slack.py --out /tmp/slack.json
    python benchmarks/host_slack.py --smoke --out /tmp/slack.json   # CPU, the 2-layer model

Writes {"batch": {"delay_us": ms_per_step}, "slack_us": {"batch": the largest D whose ms per
step is within 1% of D = 0}}."""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import engine_internals
import offline_runs
import spec_methods
from bench_args import REQUIRED, add_common, comma_ints
from offline_runs import LLAMA_8B


def spin(seconds: float) -> None:
    """Busy host work (the engine thread holds the CPU, as Python bookkeeping does)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def with_delay(llm: Any, delay_us: int) -> Any:
    """runner.finish with delay_us of busy work after it; returns the undo."""
    runner = engine_internals.runner(llm)
    finish = runner.finish

    def delayed(handle: Any) -> Any:
        out = finish(handle)
        spin(delay_us * 1e-6)
        return out

    runner.finish = delayed
    return lambda: delattr(runner, "finish")


def ms_per_step(llm: Any, prompts: list[dict], sp: Any, repeats: int) -> float:
    runs = []
    with engine_internals.step_counter(llm) as steps:
        for _ in range(repeats):
            before = steps[0]
            offline_runs.sync()
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            offline_runs.sync()
            runs.append((time.perf_counter() - t0) / (steps[0] - before) * 1e3)
    return round(sorted(runs)[len(runs) // 2], 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common(p, out=REQUIRED, model=LLAMA_8B, load_format="dummy", dtype="bfloat16",
               repeats=3, device=None, smoke="the 2-layer Llama on the CPU, 1 run")
    p.add_argument("--batch-sizes", type=comma_ints, default=[1, 32])
    p.add_argument("--delays-us", type=comma_ints, default=[0, 100, 250, 500, 1000, 2000])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    args = p.parse_args(argv)
    if any(d < 0 for d in args.delays_us) or 0 not in args.delays_us:
        raise ValueError(f"--delays-us: non-negative and including 0, got {args.delays_us}")
    if args.smoke:
        args.dtype, args.device, args.repeats = "float32", args.device or "cpu", 1
        if args.model == LLAMA_8B:
            args.model = offline_runs.tiny_llama(Path(tempfile.mkdtemp(prefix="slack-")))
    from shoal import SamplingParams

    args.num_speculative_tokens, args.rates = 0, [0.0]
    eng = offline_runs.start_engine(args.model, async_scheduling=True,
                                    **spec_methods.engine_kwargs(args, None))
    vocab = engine_internals.vocab_size(eng.llm) or 32000
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    result: dict[str, Any] = {}
    slack: dict[str, int] = {}
    for batch in args.batch_sizes:
        rng = random.Random(batch)
        prompts = [offline_runs.random_prompt(rng, args.input_len, vocab, lo=100)
                   for _ in range(batch)]
        eng.llm.generate(prompts, sp, use_tqdm=False)  # warm this batch size
        figs: dict[str, float] = {}
        for delay in sorted(args.delays_us):
            undo = with_delay(eng.llm, delay)
            try:
                figs[str(delay)] = ms_per_step(eng.llm, prompts, sp, args.repeats)
            finally:
                undo()
            print(f"batch {batch} delay {delay} us: {figs[str(delay)]} ms/step", flush=True)
        result[str(batch)] = figs
        base = figs["0"]
        slack[str(batch)] = max(int(d) for d, ms in figs.items() if ms <= base * 1.01)
    result["slack_us"] = slack
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
