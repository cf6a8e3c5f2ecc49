"""W9 (../shared/BENCHMARKS.md), the cost side of speculative decoding: Llama-3.1-8B shape,
random bf16 weights, batch 1 and 32, 128 input / 256 output tokens, greedy, ignore_eos.

    python benchmarks/spec_decode_gpu.py --out results.json
    python benchmarks/spec_decode_gpu.py --smoke --out /tmp/w9.json   # a 2-layer model, CPU
    python benchmarks/spec_decode_gpu.py --methods forced,eagle3,eagle3_confidence \
        --rates 0.0,1.0 --out results.json   # real drafters too (benchmarks/spec_methods.py)

Random weights cannot show real acceptance, so the speculating engine uses the test-only
method "test_forced_acceptance" (k = 4): every step proposes k drafts, runs the real verify
forward over k+1 positions and the real rejection sampler's work, then accepts
floor(a*k + u) of them (u uniform), keeping the target's own tokens: on average a share a
of the drafts is accepted, for a in 0.0, 0.5, 0.8, 1.0. Figures per batch size: output
tok/s and ms per engine step, plain decoding (its own engine: async scheduling and decode
CUDA graphs as usual) and speculating at each a (async scheduling: steps that verify
drafts run one at a time, the others are pipelined; verify steps replay CUDA graphs; the
adaptive budget decides how many of the k drafts a step verifies, from each request's recent
acceptance and the batch). At a = 0 the scheduler's backoff (a request whose drafts keep
failing decodes without them for a while) turns most drafting off, as it should; so the
verify step's cost over a plain decode step is taken at a = 0.5 (every step there verifies
k+1 positions: the forced rule accepts floor(0.5*4 + u) = 2 drafts, never 0).

--methods (default forced: the figures above) adds real drafters under the same forced rule
(speculative_config forced_acceptance_rate): eagle3, a random EAGLE-3 head of the target's
shape whose drafting is paid for, and eagle3_confidence, the same with confidence-scheduled
verification (benchmarks/spec_methods.py). Their records carry "method"; their summary keys
are named after it (forced keeps "spec_...").

Each engine runs in its own subprocess (an 8B model twice does not fit one memory budget)
and runs every batch size. One speculating engine per method serves all rates, its rate
changed in place (an engine internal); under SHOAL_BENCH_PUBLIC_ONLY=1 (the before/after sweep) each
rate gets its own engine, built with that acceptance_rate, and ms per step (counted on the
runner) is None. Writes one JSON list of records to --out."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import engine_internals
import offline_runs
import spec_methods
from bench_args import REQUIRED, add_common, comma_floats, comma_ints
from offline_runs import LLAMA_8B
from results_file import record, write

RATES = (0.0, 0.5, 0.8, 1.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common(p, out=REQUIRED, model=LLAMA_8B, load_format="dummy", dtype="bfloat16",
               repeats=3, device=None,
               smoke="a 2-layer Llama on the CPU (float32), batch 1 and 4, 16 in / 24 out, 1 run")
    p.add_argument("--batch-sizes", type=comma_ints, default=[1, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--rates", type=comma_floats, default=list(RATES))
    p.add_argument("--methods", type=spec_methods.parse_methods, default=["forced"],
                   help=f"comma list of {', '.join(spec_methods.METHODS)} (default: forced)")
    p.add_argument("--confidence-threshold", type=float, default=0.5,
                   help="eagle3_confidence's speculative_config confidence_threshold")
    p.add_argument("--engine", choices=("plain", "spec"), default=None,
                   help=argparse.SUPPRESS)  # the subprocess's part
    p.add_argument("--method", choices=spec_methods.METHODS, default="forced",
                   help=argparse.SUPPRESS)  # the subprocess's method
    args = p.parse_args(argv)
    if args.smoke:
        args.batch_sizes, args.input_len, args.output_len, args.repeats = [1, 4], 16, 24, 1
        args.dtype, args.device = "float32", args.device or "cpu"
        if args.model == LLAMA_8B:
            args.model = offline_runs.tiny_llama(Path(tempfile.mkdtemp(prefix="w9-smoke-")))
    return args


def _prompts(batch: int, input_len: int, vocab: int) -> list[dict]:
    rng = random.Random(batch)
    return [offline_runs.random_prompt(rng, input_len, vocab, lo=100) for _ in range(batch)]


def _timed(llm: Any, prompts: list[dict], sp: Any, repeats: int) -> dict[str, Any]:
    """Median over runs: wall, output tok/s, engine steps and ms per step (None where the
    runner's steps cannot be counted)."""
    runs = []
    with engine_internals.step_counter(llm) as steps:
        for _ in range(repeats):
            before = steps[0] if steps else 0
            offline_runs.sync()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            offline_runs.sync()
            wall = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            # the prefill step is in wall and steps alike; with batch 32 it is one step too
            count = steps[0] - before if steps else None
            runs.append({"wall_s": wall, "output_tokens": n, "output_tok_s": n / wall,
                         "steps": count, "ms_per_step": wall / count * 1000 if count else None})
    runs.sort(key=lambda r: r["wall_s"])
    return {k: round(v, 4) if isinstance(v, float) else v
            for k, v in runs[len(runs) // 2].items()}


def engine_part(args: argparse.Namespace) -> list[dict]:
    from shoal import SamplingParams

    kw = spec_methods.engine_kwargs(args, args.method if args.engine == "spec" else None,
                                    args.confidence_threshold)
    eng = offline_runs.start_engine(args.model, **kw)
    vocab = (engine_internals.vocab_size(eng.llm) or offline_runs.config_vocab_size(args.model)
             or 32000)
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    common = {"ready_s": round(eng.ready_s, 2), "process_ready_s": eng.process_ready_s}
    out = []
    for batch in args.batch_sizes:
        prompts = _prompts(batch, args.input_len, vocab)
        eng.llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)  # warm this batch size
        if args.engine == "plain":
            out.append({"engine": "plain", "batch": batch, **common,
                        **_timed(eng.llm, prompts, sp, args.repeats)})
            continue
        for i, rate in enumerate(args.rates):
            if i and not spec_methods.set_rate(eng.llm, args.method, rate):
                raise RuntimeError("cannot change the acceptance rate in place: pass one rate")
            fig = _timed(eng.llm, prompts, sp, args.repeats)
            out.append({"engine": "spec", "method": args.method, "batch": batch,
                        "acceptance_rate": rate,
                        "num_speculative_tokens": args.num_speculative_tokens, **common, **fig})
        spec_methods.set_rate(eng.llm, args.method, args.rates[0])
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.engine is not None:  # the subprocess: one engine, its figures to --out
        Path(args.out).write_text(json.dumps(engine_part(args)))
        return 0
    # One speculating engine for every rate, or one per rate when it cannot be changed.
    groups = [[r] for r in args.rates] if engine_internals.public_only() else [args.rates]
    plan = [("plain", "forced", args.rates)] + [("spec", m, g) for m in args.methods
                                                for g in groups]
    parts: dict[str, list[dict]] = {"plain": [], "spec": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (engine, method, rates) in enumerate(plan):
            part_out = Path(tmp) / f"{engine}-{i}.json"
            cmd = [sys.executable, __file__, *argv, "--model", args.model, "--engine", engine,
                   "--method", method, "--rates", ",".join(map(str, rates)),
                   "--out", str(part_out)]
            subprocess.run(cmd, check=True)
            parts[engine] += json.loads(part_out.read_text())
    records = _summarise(args, parts)
    write(records, args.out)
    print(json.dumps(records[-1]["summary"], indent=2))
    return 0


def _summarise(args: argparse.Namespace, parts: dict[str, list[dict]]) -> list[dict]:
    summary: dict[str, Any] = {}
    for batch in args.batch_sizes:
        plain = next(r for r in parts["plain"] if r["batch"] == batch)
        row: dict[str, Any] = {"plain_tok_s": plain["output_tok_s"],
                               "plain_ms_per_step": plain["ms_per_step"]}
        for r in parts["spec"]:
            if r["batch"] == batch:
                a, m = r["acceptance_rate"], spec_methods.summary_prefix(r["method"])
                row[f"{m}_a{a}_tok_s"] = r["output_tok_s"]
                row[f"{m}_a{a}_ms_per_step"] = r["ms_per_step"]
                row[f"{m}_a{a}_speedup"] = round(r["output_tok_s"] / plain["output_tok_s"], 3)
        for method in args.methods:
            m = spec_methods.summary_prefix(method)
            if row.get(f"{m}_a0.5_ms_per_step") and plain["ms_per_step"]:
                key = "verify_step" if method == "forced" else f"{m}_step_a0.5"
                row[f"{key}_over_plain_step"] = round(
                    row[f"{m}_a0.5_ms_per_step"] / plain["ms_per_step"], 3)
        summary[f"batch_{batch}"] = row
    return [record("W9", "shoal", model=args.model, load_format=args.load_format,
                   dtype=args.dtype, input_len=args.input_len, output_len=args.output_len,
                   num_speculative_tokens=args.num_speculative_tokens, runs=parts,
                   methods=args.methods, confidence_threshold=args.confidence_threshold,
                   summary=summary, public_only=engine_internals.public_only(),
                   notes="speculating engine: verify steps one at a time, steps without drafts "
                         "pipelined (async scheduling), "
                         "verify-step CUDA graphs, adaptive draft budget, backoff after "
                         "failing drafts (a=0); verify cost taken at a=0.5; plain engine: "
                         "defaults")]


if __name__ == "__main__":
    sys.exit(main())
