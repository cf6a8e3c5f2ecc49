"""Where a CPU decode step of the embedded SmolLM2-135M goes (issue 17, step 1).

    PYTHONPATH=. .venv/bin/python benchmarks/w6_cpu_profile.py \
        --out benchmarks/results/<date>-W6-cpu-profile.json

One process holds one engine per dtype (float32, bfloat16). For each (batch, context) it times
the model runner's decode step (`execute`, `sample`, `finish` on a made-up SchedulerOutput: inputs,
attention metadata, forward, LM head, sampling) in rounds that alternate the dtypes in a
shuffled order, so a busy neighbour on this shared machine slows both alike; it reports each
round's median and the median over rounds, and the CPU other processes took meanwhile. A
torch.profiler pass splits a step into matmuls, attention, KV gather/write, small ops and
Python/dispatch (the step's wall time not spent inside any op), and a real `LLM.generate`
times the engine around the runner (scheduler, update). The memory read bandwidth gives the
floor: weight bytes streamed per step over that bandwidth.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import engine_internals
from bench_args import add_common, comma_ints
from cpu_quiet import MachineLoad
from results_file import cpu_model, provenance, write

REPO = Path(__file__).resolve().parents[1]

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int4pack_mm_for_cpu",
              "aten::_weight_int8pack_mm", "aten::mkldnn_", "mkldnn::", "onednn::",
              "shoal_cpu::small_linear")
ATTENTION_OPS = ("aten::_scaled_dot_product", "shoal::", "aten::scaled_dot_product",
                 "shoal_cpu::paged_decode")
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
    """Bytes a decode step streams from memory: every linear weight (int4-packed where the
    layer holds it so) and the LM head; the input embedding is gathered, not streamed."""
    from shoal.layers.embedding import VocabParallelEmbedding

    out = {"layers": 0, "lm_head": 0}
    for name, mod in model.named_modules():
        int4 = getattr(mod, "int4", None)
        w = getattr(mod, "weight", None)
        if int4 is not None:
            out["layers"] += int4.nbytes
        elif w is None or w.dim() != 2:
            continue
        elif name.endswith("lm_head"):
            out["lm_head"] = w.numel() * w.element_size()
        elif not isinstance(mod, VocabParallelEmbedding):
            out["layers"] += w.numel() * w.element_size()
    out["total"] = out["layers"] + out["lm_head"]
    return out


# ---------------------------------------------------------------------------------------------
# A made-up decode batch through the model runner


def decode_schedule(runner: Any, batch: int, context: int, first: bool) -> Any:
    from shoal.core.scheduler_output import (
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


def run_step(runner: Any, sched: Any) -> Any:
    """One whole runner step: forward pass, sampling, results on the host."""
    handle = runner.execute(sched)
    runner.sample(handle, None)
    return runner.finish(handle)


def time_decode_steps(runner: Any, batch: int, context: int, steps: int,
                      warm: int = 1) -> dict[str, Any]:
    run_step(runner, decode_schedule(runner, batch, context, first=True))
    sched = decode_schedule(runner, batch, context, first=False)
    for _ in range(warm):
        run_step(runner, sched)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        run_step(runner, sched)
        times.append(time.perf_counter() - t)
    return {"median_ms": statistics.median(times) * 1e3, "min_ms": min(times) * 1e3,
            "tok_s_at_median": batch / statistics.median(times)}


def profile_decode_step(runner: Any, batch: int, context: int, steps: int = 5
                        ) -> dict[str, Any]:
    """torch.profiler over `steps` decode steps: self CPU time per category and op count."""
    from torch.profiler import ProfilerActivity, profile

    sched = decode_schedule(runner, batch, context, first=False)
    run_step(runner, sched)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            run_step(runner, sched)
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
    """Per step of a real generate: the core step and its parts (scheduler, runner, update)."""
    from shoal import SamplingParams

    core = engine_internals.core(llm, required=True)
    timers = engine_internals.MethodTimers()
    for obj, name, key in ((core.scheduler, "schedule", "schedule"),
                           (core.scheduler, "update", "update"),
                           (core.runner, "execute", "execute"),
                           (core.runner, "sample", "sample"),
                           (core.runner, "finish", "finish"), (core, "step", "core_step")):
        timers.wrap(obj, name, key)
    seed = int(time.time() * 1e3)  # new prompts each call: no prefix-cache hits
    prompts = [{"prompt_token_ids": [(seed + 13 * i + 7 * j) % 49000 for j in range(prompt_len)]}
               for i in range(batch)]
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    t = time.perf_counter()
    llm.generate(prompts, sp, use_tqdm=False)
    total = time.perf_counter() - t
    timers.restore()
    acc = timers.calls
    # Decode steps only: the last out_len - 1 steps (prefill steps come first).
    decode = slice(-(out_len - 1), None)
    per = {k: 1e3 * statistics.median(v[decode]) for k, v in acc.items()}
    return {"batch": batch, "steps": len(acc["core_step"]), "generate_s": round(total, 2),
            "decode_step_median_ms": {k: round(v, 3) for k, v in per.items()},
            "outside_runner_ms": round(per["core_step"] - per["execute"] - per["sample"]
                                       - per["finish"], 3)}


# ---------------------------------------------------------------------------------------------
# A/B in one process


def make_llm(variant: str, kv_gib: float, engine_args: dict[str, Any]) -> Any:
    """variant: a dtype (shoal's default for it), optionally with "+int4" (cpu_int4_matmul
    on) or "+dense" (off)."""
    from shoal import LLM

    dtype, _, extra = variant.partition("+")
    modes = {"": None, "int4": True, "dense": False}
    if extra not in modes:
        raise SystemExit(f"unknown variant {variant!r}: <dtype>, <dtype>+int4 or <dtype>+dense")
    return LLM(dtype=dtype, max_model_len=2048, kv_cache_memory_bytes=int(kv_gib * 2**30),
               cpu_int4_matmul=modes[extra], **engine_args)


def interleaved_steps(runners: dict[str, Any], batch: int, context: int, rounds: int,
                      steps: int) -> dict[str, Any]:
    """Rounds of `steps` decode steps per dtype, in a shuffled order each round."""
    order = random.Random(batch * 7919 + context)
    for r in runners.values():
        run_step(r, decode_schedule(r, batch, context, first=True))
    per_round: dict[str, list[float]] = defaultdict(list)
    others = []
    for _ in range(rounds):
        load = MachineLoad()
        for name in order.sample(sorted(runners), len(runners)):
            per_round[name].append(time_decode_steps(runners[name], batch, context,
                                                     steps)["median_ms"])
        others.append(load.result()["other_cores"])
    out: dict[str, Any] = {"rounds": rounds, "steps_per_round": steps,
                           "other_cores_per_round": others}
    for name, ms in per_round.items():
        med = statistics.median(ms)
        out[name] = {"median_ms": round(med, 2), "round_medians_ms": [round(x, 2) for x in ms],
                     "tok_s": round(batch * 1e3 / med, 1)}
    # Paired per round: each variant's step time over the first variant's.
    names = list(runners)
    for b in names[1:]:
        ratios = [x / y for x, y in zip(per_round[b], per_round[names[0]])]
        out[f"{b}_time_over_{names[0]}"] = {"median": round(statistics.median(ratios), 3),
                                             "min": round(min(ratios), 3),
                                             "max": round(max(ratios), 3)}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--variants", default="float32,bfloat16",
                    help="engines compared: a dtype, or dtype+int4 (cpu_int4_matmul)")
    ap.add_argument("--engine-args", default="{}", help="JSON of extra LLM(...) arguments")
    ap.add_argument("--kv-gib", type=float, default=2.0, help="KV cache per engine")
    ap.add_argument("--batches", type=comma_ints,
                    default=[64, 1])
    ap.add_argument("--contexts", type=comma_ints,
                    default=[600, 192], help="context length per batch size, in order")
    add_common(ap, rounds=5, out=REPO / "bench-work" / "w6" / "profile.json")
    ap.add_argument("--steps", type=int, default=5, help="decode steps per round")
    ap.add_argument("--engine-split-batches", type=comma_ints,
                    default=[64, 1], help="batch sizes to time a real generate for ('' none)")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--no-profile", action="store_true", help="step timings only")
    args = ap.parse_args()
    import torch
    engine_args = json.loads(args.engine_args)
    res: dict[str, Any] = {**provenance(), "engine_args": engine_args,
                           "threads": torch.get_num_threads(),
                           "torch": torch.__version__, "cpu": cpu_model()}
    load = MachineLoad()
    res["bandwidth"] = [read_bandwidth(n) for n in sorted({1, torch.get_num_threads()})]
    res["bandwidth_load"] = load.result()
    llms = {}
    for dtype in args.variants.split(","):
        t = time.perf_counter()
        llms[dtype] = make_llm(dtype, args.kv_gib, engine_args)
        res.setdefault("llm_ready_s", {})[dtype] = round(time.perf_counter() - t, 2)
    runners = {d: engine_internals.core(llm, required=True).runner
               for d, llm in llms.items()}
    bw = max(b["read_gb_s"] for b in res["bandwidth"])
    res["weights"] = {}
    for d, r in runners.items():
        w = streamed_weight_bytes(r.model)
        res["weights"][d] = {"bytes": w,
                             "floor_ms_per_step": {k: round(v / bw / 1e6, 3)
                                                   for k, v in w.items()}}
    res["cases"] = []
    for batch, context in zip(args.batches, args.contexts):
        case: dict[str, Any] = {"batch": batch, "context": context}
        case["step_ab"] = interleaved_steps(runners, batch, context, args.rounds, args.steps)
        case["profile"] = {}
        for d, r in ([] if args.no_profile else runners.items()):
            load = MachineLoad()
            case["profile"][d] = profile_decode_step(r, batch, context, args.profile_steps)
            case["profile"][d]["load"] = load.result()
        if batch in args.engine_split_batches:
            case["engine"] = {}
            for d, llm in llms.items():
                load = MachineLoad()
                case["engine"][d] = engine_split(llm, batch, 128, 32)
                case["engine"][d]["load"] = load.result()
        res["cases"].append(case)
        print(json.dumps(case, indent=1), flush=True)
    for llm in llms.values():
        llm.shutdown()
    write(res, args.out, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "cases"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
