"""Where a CPU decode step of the embedded SmolLM2-135M goes (issue 17, step 1).

    .venv/bin/python benchmarks/w6_cpu_profile.py --dtype bfloat16 --out bench-work/w6/prof.json
    .venv/bin/python benchmarks/w6_cpu_profile.py --pyspy       # + py-spy of the engine loop

For each (batch, context) it times the model runner's decode step (`ModelRunner.execute` on
a made-up SchedulerOutput: inputs, attention metadata, forward, LM head, sampling), splits
it by torch.profiler into matmuls, attention, small ops and the rest, and times the engine
around it (scheduler, update) in a real `LLM.generate`. It also measures the memory read
bandwidth and the floor it sets: weight bytes streamed per step over that bandwidth. The
machine must be quiet (cpu_quiet.py); other processes' CPU use is recorded per measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from cpu_quiet import measure_quietly

REPO = Path(__file__).resolve().parents[1]

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int4pack_mm_for_cpu",
              "aten::_weight_int8pack_mm", "aten::mkldnn_", "mkldnn::", "onednn::")
ATTENTION_OPS = ("aten::_scaled_dot_product", "shoal::", "aten::scaled_dot_product")
KV_OPS = ("aten::index_select", "aten::index_copy_", "aten::index_put_")
# Ops whose time is their children's (counted there), or the profiler's own.
WRAPPER_OPS = ("aten::linear", "aten::matmul", "aten::scaled_dot_product_attention",
               "Torch-Compiled Region", "CompiledFunction", "## Call CompiledFxGraph")


def category(name: str) -> str:
    if name.startswith(MATMUL_OPS):
        return "matmul"
    if name.startswith(ATTENTION_OPS):
        return "attention"
    if name.startswith(KV_OPS):
        return "kv_gather_write"
    if name.startswith(("graph_", "cpp_fused", "kernel_cpp")):
        return "compiled_kernels"
    return "small_ops"


# ---------------------------------------------------------------------------------------------
# Memory bandwidth and the weights floor


def read_bandwidth(threads: int, gib: float = 1.0) -> dict[str, float]:
    """GB/s of a sum over a buffer far larger than the caches (read) and of a copy (read +
    write, counted both ways), best of 5."""
    import torch

    torch.set_num_threads(threads)
    n = int(gib * 2**30) // 4
    a, b = torch.ones(n), torch.empty(n)
    reads, copies = [], []
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        reads.append(time.perf_counter() - t)
        t = time.perf_counter()
        b.copy_(a)
        copies.append(time.perf_counter() - t)
    return {"threads": threads, "read_gb_s": n * 4 / min(reads) / 1e9,
            "copy_gb_s": 2 * n * 4 / min(copies) / 1e9}


def streamed_weight_bytes(model: Any) -> dict[str, int]:
    """Bytes a decode step streams from memory: every linear weight (in whatever form the
    layer holds it) and the LM head; the input embedding is gathered, not streamed."""
    try:
        from shoal.layers.quant.linear_method import streamed_bytes
    except ImportError:  # before quantized layers existed: dense weights only
        from shoal.layers.embedding import VocabParallelEmbedding

        out = {"layers": 0, "lm_head": 0}
        for name, mod in model.named_modules():
            w = getattr(mod, "weight", None)
            if w is None or w.dim() != 2:
                continue
            if name.endswith("lm_head"):
                out["lm_head"] = w.numel() * w.element_size()
            elif not isinstance(mod, VocabParallelEmbedding):
                out["layers"] += w.numel() * w.element_size()
        out["total"] = out["layers"] + out["lm_head"]
        return out
    return streamed_bytes(model)


# ---------------------------------------------------------------------------------------------
# A made-up decode batch through the model runner


def decode_schedule(runner: Any, batch: int, context: int, first: bool) -> Any:
    from shoal.engine.scheduler_output import (
        NewRequestData,
        ScheduledRequest,
        SchedulerOutput,
    )
    from shoal.sampling_params import SamplingParams

    bs = runner.block_size
    per = -(-(context + 1) // bs)
    items, new = [], []
    for i in range(batch):
        blocks = list(range(i * per, (i + 1) * per))
        items.append(ScheduledRequest(f"p{i}", 10_000 + i, [(7 * i + 3) % 49000], context,
                                      blocks, True, 1))
        if first:
            new.append(NewRequestData(f"p{i}", 10_000 + i, [1] * context,
                                      SamplingParams(temperature=0, max_tokens=10**6,
                                                     ignore_eos=True), frozenset()))
    return SchedulerOutput(scheduled=items, num_decodes=batch, new_requests=new)


def time_decode_steps(runner: Any, batch: int, context: int, steps: int) -> dict[str, Any]:
    runner.execute(decode_schedule(runner, batch, context, first=True))
    sched = decode_schedule(runner, batch, context, first=False)
    for _ in range(3):
        runner.execute(sched)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        runner.execute(sched)
        times.append(time.perf_counter() - t)
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
            "tok_s_at_median": batch / statistics.median(times)}


def profile_decode_step(runner: Any, batch: int, context: int, steps: int = 5
                        ) -> dict[str, Any]:
    """torch.profiler over `steps` decode steps: self CPU time per category and op count."""
    from torch.profiler import ProfilerActivity, profile

    sched = decode_schedule(runner, batch, context, first=False)
    runner.execute(sched)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            runner.execute(sched)
        wall = (time.perf_counter() - t) / steps
    cats: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    top = []
    for ev in prof.key_averages():
        if ev.key.startswith(WRAPPER_OPS) or ev.key.startswith("ProfilerStep"):
            continue
        c = category(ev.key)
        cats[c] += ev.self_cpu_time_total / 1e3 / steps
        counts[c] += ev.count // steps
        top.append((ev.self_cpu_time_total / 1e3 / steps, ev.count // steps, ev.key))
    top.sort(reverse=True)
    ops_ms = sum(cats.values())
    return {"wall_ms_under_profiler": wall * 1e3,
            "self_ms_by_category": {k: round(v, 3) for k, v in cats.items()},
            "ops_per_step_by_category": dict(counts),
            "ops_per_step": sum(counts.values()),
            "python_and_dispatch_ms": round(wall * 1e3 - ops_ms, 3),
            "top_ops": [{"self_ms": round(ms, 3), "calls": n, "op": k}
                        for ms, n, k in top[:15]]}


# ---------------------------------------------------------------------------------------------
# The engine around the runner: scheduler, update, output handling


def engine_split(llm: Any, batch: int, prompt_len: int, out_len: int) -> dict[str, Any]:
    """Per decode step of a real generate: total step time and the runner's part of it."""
    from shoal import SamplingParams

    core = llm.llm_engine.core
    acc: dict[str, list[float]] = defaultdict(list)

    def wrap(obj: Any, name: str, key: str) -> Any:
        orig = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                acc[key].append(time.perf_counter() - t)

        setattr(obj, name, timed)
        return orig

    originals = [(core.scheduler, "schedule", wrap(core.scheduler, "schedule", "schedule")),
                 (core.scheduler, "update", wrap(core.scheduler, "update", "update")),
                 (core.runner, "launch", wrap(core.runner, "launch", "runner")),
                 (core, "step", wrap(core, "step", "core_step"))]
    prompts = [{"prompt_token_ids": [(13 * i + j) % 49000 for j in range(prompt_len)]}
               for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    total = time.perf_counter() - t
    for obj, name, orig in originals:
        setattr(obj, name, orig)
    steps = len(acc["core_step"])
    # Decode steps only: drop the prefill steps at the start (the slowest ones).
    decode = sorted(acc["core_step"])[: max(1, steps - 2 * (1 + batch * prompt_len // 2048))]
    return {"batch": batch, "steps": steps, "generate_s": total,
            "median_step_ms": statistics.median(decode) * 1e3,
            "ms_per_step": {k: 1e3 * sum(v) / steps for k, v in acc.items()},
            "outside_core_step_ms": 1e3 * (total - sum(acc["core_step"])) / steps}


def pyspy_engine(args: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    """py-spy (native frames) over a generate of `--batches[0]` requests; leaf frames are
    counted by library: Python interpreter, torch dispatch, compute libraries."""
    raw = out_dir / "pyspy-raw.txt"
    child = [sys.executable, str(Path(__file__).resolve()), "--child-generate",
             "--dtype", args.dtype, "--engine-args", args.engine_args,
             "--batches", str(args.batches[0])]
    cmd = [str(REPO / ".venv" / "bin" / "py-spy"), "record", "--native", "-r", "200",
           "--format", "raw", "-o", str(raw), "--", *child]
    subprocess.run(cmd, check=True, capture_output=True)
    return summarize_pyspy(raw)


def summarize_pyspy(raw: Path) -> dict[str, Any]:
    by_leaf: dict[str, int] = defaultdict(int)
    in_step = 0
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if "time_decode_steps" not in stack:
            continue
        count = int(n)
        total += count
        in_step += count
        leaf = stack.split(";")[-1]
        by_leaf[leaf_library(leaf)] += count
    return {"samples_in_decode_loop": total,
            "share_by_leaf": {k: round(v / max(total, 1), 3)
                              for k, v in sorted(by_leaf.items(), key=lambda kv: -kv[1])}}


def leaf_library(frame: str) -> str:
    if "(libpython" in frame or frame.endswith(".py)") or ".py:" in frame:
        return "python"
    for lib, name in (("libgomp", "openmp"), ("libiomp", "openmp"), ("libmkl", "mkl"),
                      ("dnnl", "onednn"), ("libtorch_cpu", "torch_cpu"),
                      ("libc10", "torch_c10"), ("libtorch_python", "torch_python"),
                      ("libc.so", "libc"), ("torchinductor", "inductor_kernels")):
        if lib in frame:
            return name
    return "other_native"


def child_generate(args: argparse.Namespace) -> int:
    """The py-spy target: decode steps of the batch through the model runner."""
    llm = make_llm(args)
    runner = llm.llm_engine.core.runner
    time_decode_steps(runner, args.batches[0], args.contexts[0], 60)
    return 0


def make_llm(args: argparse.Namespace) -> Any:
    from shoal import LLM

    return LLM(dtype=args.dtype, max_model_len=2048, **json.loads(args.engine_args))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--engine-args", default="{}", help="JSON of extra LLM(...) arguments")
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")],
                    default=[64, 1])
    ap.add_argument("--contexts", type=lambda s: [int(x) for x in s.split(",")],
                    default=[600, 192], help="context length per batch size, in order")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pyspy", action="store_true")
    ap.add_argument("--out", type=Path, default=REPO / "bench-work" / "w6" / "profile.json")
    ap.add_argument("--child-generate", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_generate:
        return child_generate(args)
    import torch

    res: dict[str, Any] = {"dtype": args.dtype, "engine_args": json.loads(args.engine_args),
                           "threads": torch.get_num_threads()}
    res["bandwidth"], res["bandwidth_quiet"] = measure_quietly(
        lambda: [read_bandwidth(n) for n in sorted({1, torch.get_num_threads()})])
    t = time.perf_counter()
    llm = make_llm(args)
    res["llm_ready_s"] = time.perf_counter() - t
    runner = llm.llm_engine.core.runner
    res["weights"] = streamed_weight_bytes(runner.model)
    bw = max(b["read_gb_s"] for b in res["bandwidth"])
    res["floor_ms_per_step"] = {k: v / bw / 1e6 for k, v in res["weights"].items()}
    res["cases"] = []
    for batch, context in zip(args.batches, args.contexts):
        case: dict[str, Any] = {"batch": batch, "context": context}
        case["step"], case["step_quiet"] = measure_quietly(
            lambda: time_decode_steps(runner, batch, context, args.steps))
        case["profile"], case["profile_quiet"] = measure_quietly(
            lambda: profile_decode_step(runner, batch, context))
        case["engine"], case["engine_quiet"] = measure_quietly(
            lambda: engine_split(llm, batch, 128, 64))
        res["cases"].append(case)
        print(json.dumps(case, indent=1), flush=True)
    llm.shutdown()
    if args.pyspy:
        res["pyspy"], res["pyspy_quiet"] = measure_quietly(
            lambda: pyspy_engine(args, args.out.parent))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "cases"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
