"""W1 and W3 throughput of the Llama-3.1-8B shape with FP8 weights and with FP8 KV (issue 31,
BENCHMARKS.md W12), beside bf16, on one GPU (random weights, load_format="dummy").

    python benchmarks/quant_throughput_gpu.py --out bench-work/quant-w3.json
    python benchmarks/quant_throughput_gpu.py --smoke --out /tmp/qt.json   # CPU, tiny Llama

Cases (weights, KV cache dtype): bf16/auto, bf16/fp8, fp8_channel/auto, fp8_channel/fp8
(--cases picks; fp8_block and int4_g128 weights are accepted too). Each case is one engine in
its own subprocess (the GPU empty for each), max_model_len 2048, max_num_seqs 256:
- w1: the W1 requests (offline_runs.w1_requests: 256, U[100,1024] in and out, temperature 0.6)
  over the 8B shape's vocabulary, output tok/s;
- w3: --w3-requests requests of 1000 random ids, 1000 out, greedy, ignore_eos, output tok/s.
  The W3 preset has 1,024 requests (1M output tokens, minutes per case); 256 by default keeps
  four cases in one device call: say so beside the figure;
- kv_blocks: the pool's block count from the engine's start-up log line (FP8 KV: about twice).
Ratios against bf16/auto follow each case (`over_bf16`)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import offline_runs
from bench_args import add_common, comma_words
from offline_runs import LLAMA_8B
from quant_gpu import QUANT_CONFIGS, variant_folder
from results_file import record, write

CASES = ("bf16/auto", "bf16/fp8", "fp8_channel/auto", "fp8_channel/fp8")
KV_LOG = re.compile(r"KV cache: (\d+) blocks of (\d+) tokens")


class PoolLog(logging.Handler):
    """The engine's start-up line `KV cache: N blocks of M tokens` (the pool it sized)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.found: list[tuple[str, str]] = []

    def emit(self, rec: logging.LogRecord) -> None:
        self.found += KV_LOG.findall(rec.getMessage())

    def blocks(self) -> dict[str, int]:
        if not self.found:
            return {}
        return {"kv_blocks": int(self.found[-1][0]), "block_size": int(self.found[-1][1])}


def one_case(args: argparse.Namespace) -> dict[str, Any]:
    """One case's engine (run in a subprocess by main)."""
    from shoal import SamplingParams

    weights, kv = args.case.split("/")
    kw: dict[str, Any] = dict(load_format="dummy", dtype=args.engine_dtype,
                              max_model_len=2048 if not args.smoke else 256,
                              max_num_seqs=256 if not args.smoke else 8, kv_cache_dtype=kv)
    if weights == "fp8_channel":
        kw["quantization"] = "fp8"
    if args.smoke:
        kw |= {"kv_cache_memory_bytes": 32 << 20, "device": "cpu"}
    pool_lines = PoolLog()
    logging.getLogger("shoal").addHandler(pool_lines)
    logging.getLogger("shoal").setLevel(logging.INFO)
    eng = offline_runs.start_engine(args.model_path, **kw)
    cfg = json.loads((offline_runs.shipped_folder(args.model) / "config.json").read_text())
    vocab = int(cfg["vocab_size"])
    n_w1, w3_len = (8, 16) if args.smoke else (256, 1000)
    lengths = dict(in_range=(8, 32), out_range=(4, 16)) if args.smoke else {}
    prompts, params, _, _ = offline_runs.w1_requests(n_w1, hi=min(vocab, 10000), **lengths)
    w1 = offline_runs.throughput(eng.llm, prompts, params)
    rng = random.Random(0)
    w3_prompts = [offline_runs.random_prompt(rng, w3_len, vocab) for _ in range(args.w3_requests)]
    greedy = SamplingParams(temperature=0, max_tokens=w3_len, ignore_eos=True)
    w3 = offline_runs.throughput(eng.llm, w3_prompts, greedy)
    return dict(case=args.case, ready_s=eng.ready_s, w1=w1, w3=w3,
                w3_requests=args.w3_requests, w3_len=w3_len, **pool_lines.blocks())


def run_case(args: argparse.Namespace, case: str, root: Path) -> dict[str, Any]:
    weights = case.split("/")[0]
    base = offline_runs.shipped_folder(args.model)
    folder = variant_folder(weights, base, root) if weights in QUANT_CONFIGS else base
    out = root / f"{case.replace('/', '-')}.json"
    cmd = [sys.executable, __file__, "--case", case, "--out", str(out), "--model", args.model,
           "--model-path", str(folder), "--engine-dtype", args.engine_dtype,
           "--w3-requests", str(args.w3_requests)] + (["--smoke"] if args.smoke else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    row: dict[str, Any] = {"case": case}
    if proc.returncode == 0 and out.exists():
        row |= json.loads(out.read_text())
    else:
        row["error"] = (proc.stderr or proc.stdout)[-3000:]
    row["wall_s"] = time.perf_counter() - t0
    return row


def with_ratios(rows: dict[str, dict[str, Any]]) -> None:
    base = rows.get("bf16/auto", {})
    for row in rows.values():
        row["over_bf16"] = {k: row[k]["output_tok_s"] / base[k]["output_tok_s"]
                            for k in ("w1", "w3") if k in row and k in base}
        if "kv_blocks" in row and "kv_blocks" in base:
            row["over_bf16"]["kv_blocks"] = row["kv_blocks"] / base["kv_blocks"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common(p, out=None, model=LLAMA_8B, smoke="a tiny Llama on the CPU, 8 W1 requests")
    p.add_argument("--cases", type=comma_words, default=list(CASES))
    p.add_argument("--w3-requests", type=int, default=None)
    p.add_argument("--timeout", type=int, default=240, help="seconds per case")
    p.add_argument("--case", default=None, help=argparse.SUPPRESS)  # the subprocess
    p.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--engine-dtype", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.engine_dtype = args.engine_dtype or ("float32" if args.smoke else "bfloat16")
    args.w3_requests = args.w3_requests or (4 if args.smoke else 256)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.out is None:
        p.error("--out is required")
    if args.case is not None:
        write(one_case(args), args.out)
        return 0
    for case in args.cases:
        weights, _, kv = case.partition("/")
        if weights not in ("bf16", "fp8_channel", *QUANT_CONFIGS) or kv not in ("auto", "fp8"):
            p.error(f"--cases: {case!r} is not weights/kv (weights bf16, fp8_channel, "
                    f"{', '.join(QUANT_CONFIGS)}; kv auto or fp8)")
    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="quant_tp_") as tmp:
        if args.smoke:
            args.model = offline_runs.tiny_llama(Path(tmp) / "tiny")
        for case in args.cases:
            try:
                rows[case] = run_case(args, case, Path(tmp))
            except Exception as e:  # (a timeout): the other cases still run
                traceback.print_exc()
                rows[case] = {"case": case, "error": f"{type(e).__name__}: {e}"}
            print(json.dumps({k: v for k, v in rows[case].items() if k != "error"}), flush=True)
            with_ratios(rows)
            write([record("quant_throughput", "shoal", smoke=args.smoke, model=args.model,
                          cases=rows)], args.out)
    return 0 if all("error" not in r for r in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
