"""W9 (../shared/BENCHMARKS.md), the cost side of speculative decoding: Llama-3.1-8B shape,
random bf16 weights, batch 1 and 32, 128 input / 256 output tokens, greedy, ignore_eos.

    python benchmarks/spec_decode_gpu.py --out results.json
    python benchmarks/spec_decode_gpu.py --smoke --model <tiny folder> --load-format auto \
        --dtype float32 --out /tmp/w9.json          # a quick check (CPU works too)

Random weights cannot show real acceptance, so the speculating engine uses the test-only
method "test_forced_acceptance" (k = 4): every step proposes k drafts, runs the real verify
forward over k+1 positions and the real rejection sampler's work, then accepts
floor(a*k + u) of them (u uniform), keeping the target's own tokens: on average a share a
of the drafts is accepted, for a in 0.0, 0.5, 0.8, 1.0. Figures per batch size: output
tok/s and ms per engine step, plain decoding (its own engine: async scheduling and decode
CUDA graphs as usual) and speculating at each a (async scheduling: steps that verify
drafts run one at a time, the others are pipelined; verify steps replay CUDA graphs; the adaptive budget decides how many of the k
drafts a step verifies, from each request's recent acceptance and the batch). At a = 0 the scheduler's backoff (a request whose drafts keep failing decodes
without them for a while) turns most drafting off, as it should; so the verify step's cost
over a plain decode step is taken at a = 0.5 (every step there verifies k+1 positions: the
forced rule accepts floor(0.5*4 + u) = 2 drafts, never 0).

Each engine runs in its own subprocess (an 8B model twice does not fit one memory budget).
Writes one JSON list of records to --out."""

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

LLAMA_8B = "meta-llama/Llama-3.1-8B"
RATES = (0.0, 0.5, 0.8, 1.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="JSON file for the results")
    p.add_argument("--model", default=LLAMA_8B)
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--rates", default=",".join(str(r) for r in RATES))
    p.add_argument("--repeats", type=int, default=3, help="timed runs per figure (median)")
    p.add_argument("--smoke", action="store_true", help="batch 1 and 4, 16 in / 24 out, 1 run")
    p.add_argument("--engine", choices=("plain", "spec"), default=None,
                   help=argparse.SUPPRESS)  # the subprocess's part
    return p.parse_args(argv)


def _prompts(batch: int, input_len: int, vocab: int) -> list[dict]:
    rng = random.Random(batch)
    return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(input_len)]}
            for _ in range(batch)]


def _timed(llm: Any, prompts: list[dict], sp: Any, repeats: int) -> dict[str, float]:
    """Median over runs: wall, output tok/s, engine steps and ms per step."""
    core = llm.llm_engine.core
    launch = core.runner.launch
    steps = [0]

    def counted(sched):
        if not sched.is_empty:
            steps[0] += 1
        return launch(sched)
    core.runner.launch = counted
    runs = []
    try:
        for _ in range(repeats):
            steps[0] = 0
            _sync()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp, use_tqdm=False)
            _sync()
            wall = time.perf_counter() - t0
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            # the prefill step is in wall and steps alike; with batch 32 it is one step too
            runs.append({"wall_s": wall, "output_tokens": n, "output_tok_s": n / wall,
                         "steps": steps[0], "ms_per_step": wall / steps[0] * 1000})
    finally:
        core.runner.launch = launch
    runs.sort(key=lambda r: r["wall_s"])
    return {k: round(v, 4) if isinstance(v, float) else v
            for k, v in runs[len(runs) // 2].items()}


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def engine_part(args: argparse.Namespace) -> list[dict]:
    from shoal import LLM, SamplingParams

    kw: dict[str, Any] = dict(load_format=args.load_format, dtype=args.dtype,
                              max_model_len=args.input_len + args.output_len + 64,
                              max_num_seqs=max(args.batch_sizes))
    if args.engine == "spec":
        kw["speculative_config"] = {"method": "test_forced_acceptance",
                                    "num_speculative_tokens": args.num_speculative_tokens,
                                    "acceptance_rate": 0.0}
    t0 = time.perf_counter()
    llm = LLM(args.model, **kw)
    ready = time.perf_counter() - t0
    vocab = llm.llm_engine.core.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    out = []
    for batch in args.batch_sizes:
        prompts = _prompts(batch, args.input_len, vocab)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                     use_tqdm=False)  # warm this batch size
        if args.engine == "plain":
            out.append({"engine": "plain", "batch": batch, "ready_s": round(ready, 2),
                        **_timed(llm, prompts, sp, args.repeats)})
            continue
        proposer = llm.llm_engine.core.runner.proposer
        for rate in args.rates:
            proposer.rate = rate  # ForcedAcceptance: the share of drafts to accept
            fig = _timed(llm, prompts, sp, args.repeats)
            out.append({"engine": "spec", "batch": batch, "acceptance_rate": rate,
                        "num_speculative_tokens": args.num_speculative_tokens,
                        "ready_s": round(ready, 2), **fig})
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        args.batch_sizes, args.input_len, args.output_len, args.repeats = "1,4", 16, 24, 1
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",")]
    args.rates = [float(r) for r in str(args.rates).split(",")]
    if args.engine is not None:  # the subprocess: one engine, its figures to --out
        Path(args.out).write_text(json.dumps(engine_part(args)))
        return 0
    parts: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for engine in ("plain", "spec"):
            part_out = Path(tmp) / f"{engine}.json"
            cmd = [sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                   "--engine", engine, "--out", str(part_out)]
            subprocess.run(cmd, check=True)
            parts[engine] = json.loads(part_out.read_text())
    records = _summarise(args, parts)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(records, indent=2) + "\n")
    print(json.dumps(records[-1]["summary"], indent=2))
    print(f"wrote {args.out}")
    return 0


def _summarise(args: argparse.Namespace, parts: dict[str, list[dict]]) -> list[dict]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_common import record

    summary: dict[str, Any] = {}
    for batch in args.batch_sizes:
        plain = next(r for r in parts["plain"] if r["batch"] == batch)
        row: dict[str, Any] = {"plain_tok_s": plain["output_tok_s"],
                               "plain_ms_per_step": plain["ms_per_step"]}
        for r in parts["spec"]:
            if r["batch"] == batch:
                a = r["acceptance_rate"]
                row[f"spec_a{a}_tok_s"] = r["output_tok_s"]
                row[f"spec_a{a}_ms_per_step"] = r["ms_per_step"]
                row[f"spec_a{a}_speedup"] = round(r["output_tok_s"] / plain["output_tok_s"], 3)
        if "spec_a0.5_ms_per_step" in row:
            row["verify_step_over_plain_step"] = round(
                row["spec_a0.5_ms_per_step"] / plain["ms_per_step"], 3)
        summary[f"batch_{batch}"] = row
    return [record("W9", "shoal", model=args.model, load_format=args.load_format,
                   dtype=args.dtype, input_len=args.input_len, output_len=args.output_len,
                   num_speculative_tokens=args.num_speculative_tokens, runs=parts,
                   summary=summary,
                   notes="speculating engine: verify steps one at a time, steps without drafts "
                         "pipelined (async scheduling), "
                         "verify-step CUDA graphs, adaptive draft budget, backoff after "
                         "failing drafts (a=0); verify cost taken at a=0.5; plain engine: "
                         "defaults")]


if __name__ == "__main__":
    sys.exit(main())
