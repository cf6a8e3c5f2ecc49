"""Where a CPU decode step of a hybrid linear-attention model goes, with linear attention's
decode step as torch ops and as the C++ kernel (issue 30; shoal/layers/ops/cpu_linear_state.py).

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/hybrid_cpu_profile.py --out FILE.json \
        [--dtypes bfloat16,float32] [--batches 1,8] [--context 256] [--variants torch,kernel]

The model is Qwen3.5-0.8B-shaped (hidden 1024, 16 key and 16 value heads of 128 in the Gated
DeltaNet layers, gated attention of 8 x 256 heads, 2 KV heads) cut to 12 layers, 3 linear to
1 full, random weights (load_format="dummy"); --vocab shrinks the LM head (default: the real
248320). For each dtype and batch it times the runner's decode step (a made-up decode batch as
w6_cpu_profile's: forward, LM head, sampling) in rounds that alternate the variants, each round
after waiting for a quiet machine (rounds a neighbour disturbed anyway are left out of the
median), then splits a step two ways:

- timers (no profiler): wall time inside the linear layers' decode path (LinearAttention
  ._decodes: the state gather, conv step, q/k norms, the recurrent rule, the state scatter, or
  the one C++ call), their gated RMSNorm (output() less its out-projection);
- torch.profiler: self time of GEMMs against everything else, inside and outside those parts.

One process, the engines built in turn."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import engine_internals
from bench_args import comma_ints
from cpu_quiet import MachineLoad, wait_quiet
from results_file import cpu_model, provenance, write
from w6_cpu_profile import MATMUL_OPS, WRAPPER_OPS, run_step

LAYERS = 12
QUIET_CORES = 0.25


def qwen35_small_config(vocab: int) -> dict[str, Any]:
    """Qwen3.5-0.8B's text shapes, LAYERS layers (every fourth full attention)."""
    return {
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": LAYERS,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "attn_output_gate": True, "attention_bias": False, "partial_rotary_factor": 0.25,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                            "partial_rotary_factor": 0.25},
        "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                        for i in range(LAYERS)],
        "full_attention_interval": 4, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096, "vocab_size": vocab, "tie_word_embeddings": True,
        "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }


class PartTimers:
    """Wall time of the linear layers' decode path and gated norm, by wrapping their methods
    (class-wide; restore() puts them back). With `label`, each call also opens a profiler
    range of that name."""

    def __init__(self, label: bool = False):
        from shoal.layers.linear_attention import LinearAttention

        self.ms: dict[str, float] = defaultdict(float)
        self.cls = LinearAttention
        self._saved: list[tuple[type, str, Any]] = []
        decodes = LinearAttention._decodes
        self._patch(LinearAttention, "_decodes", self._timed("la_decode_path", decodes, label))
        for sub in LinearAttention.__subclasses__():
            if "output" in vars(sub):
                self._patch(sub, "output", self._timed_output(sub.output, label))

    def _patch(self, cls: type, name: str, fn: Any) -> None:
        self._saved.append((cls, name, vars(cls)[name]))
        setattr(cls, name, fn)

    @contextmanager
    def _range(self, key: str, label: bool):
        from torch.profiler import record_function

        t = time.perf_counter()
        if label:
            with record_function(key):
                yield
        else:
            yield
        self.ms[key] += (time.perf_counter() - t) * 1e3

    def _timed(self, key: str, fn: Any, label: bool) -> Any:
        def wrapped(layer: Any, *a: Any, **kw: Any) -> Any:
            with self._range(key, label):
                return fn(layer, *a, **kw)
        return wrapped

    def _timed_output(self, fn: Any, label: bool) -> Any:
        """output() less its out-projection: the gated RMSNorm."""
        timers = self

        def wrapped(layer: Any, *a: Any, **kw: Any) -> Any:
            proj_name = "out_proj" if hasattr(layer, "out_proj") else "o_proj"
            proj = getattr(layer, proj_name)
            inner = proj.forward

            def timed_proj(x: Any) -> Any:
                with timers._range("la_out_proj", label):
                    return inner(x)
            proj.forward = timed_proj
            try:
                with timers._range("la_output_total", label):
                    return fn(layer, *a, **kw)
            finally:
                del proj.forward
        return wrapped

    def restore(self) -> None:
        for cls, name, fn in reversed(self._saved):
            setattr(cls, name, fn)

    def split(self, steps: int) -> dict[str, float]:
        per = {k: v / steps for k, v in self.ms.items()}
        gated = per.get("la_output_total", 0.0) - per.get("la_out_proj", 0.0)
        return {"decode_path_ms": round(per.get("la_decode_path", 0.0), 3),
                "gated_norm_ms": round(gated, 3),
                "linear_decode_total_ms": round(per.get("la_decode_path", 0.0) + gated, 3)}


def decode_schedule(runner: Any, batch: int, context: int, first: bool) -> Any:
    """w6_cpu_profile's made-up decode batch with a table per KV cache group: the attention
    blocks of request i, then (state groups) blocks after every request's attention blocks."""
    from shoal.core.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput
    from shoal.sampling_params import SamplingParams

    bs = runner.block_size
    per = -(-(context + 1) // bs)
    groups = len(runner.kv_groups)
    items, new = [], []
    for i in range(batch):
        tables = [list(range((g * batch + i) * per, (g * batch + i + 1) * per))
                  for g in range(groups)]
        items.append(ScheduledRequest(f"p{i}", 10_000 + i, [(7 * i + 3) % 49000], context,
                                      tables[0], True, 1, group_block_ids=tuple(tables[1:])))
        if first:
            new.append(NewRequestData(f"p{i}", 10_000 + i, [1] * context,
                                      SamplingParams(temperature=0, max_tokens=10**6,
                                                     ignore_eos=True), frozenset()))
    return SchedulerOutput(scheduled=items, num_decodes=batch, new_requests=new)


def timed_steps(runner: Any, sched: Any, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        run_step(runner, sched)
        times.append((time.perf_counter() - t) * 1e3)
    return times


def profile_split(runner: Any, sched: Any, steps: int) -> dict[str, Any]:
    """Self CPU time by (part, GEMM or not) under torch.profiler; a part is the innermost
    linear-layer range an op runs in (la_decode_path, la_out_proj, la_output_total: the gated
    norm) or 'rest'."""
    from torch.profiler import ProfilerActivity, profile

    timers = PartTimers(label=True)
    try:
        run_step(runner, sched)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t = time.perf_counter()
            for _ in range(steps):
                run_step(runner, sched)
            wall = (time.perf_counter() - t) / steps * 1e3
    finally:
        timers.restore()
    parts: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    top: dict[tuple[str, str], float] = defaultdict(float)
    labels = {"la_decode_path", "la_out_proj", "la_output_total"}
    for ev in prof.events():
        if ev.name in labels or ev.name.startswith(WRAPPER_OPS):
            continue
        part, p = "rest", ev.cpu_parent
        while p is not None:
            if p.name in labels:
                part = p.name
                break
            p = p.cpu_parent
        kind = "gemm" if ev.name.startswith(MATMUL_OPS) else "other_ops"
        parts[f"{part}:{kind}"] += ev.self_cpu_time_total / 1e3 / steps
        counts[part] += 1
        if part != "rest":
            top[(part, ev.name)] += ev.self_cpu_time_total / 1e3 / steps
    ranges = {k: 0.0 for k in labels}
    for ev in prof.events():
        if ev.name in labels:
            ranges[ev.name] += ev.cpu_time_total / 1e3 / steps
    gaps = {k: round(ranges[k] - parts.get(f"{k}:gemm", 0) - parts.get(f"{k}:other_ops", 0)
                     - (ranges["la_out_proj"] if k == "la_output_total" else 0), 3)
            for k in ("la_decode_path", "la_output_total")}
    rest_ops: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        if not ev.key.startswith(WRAPPER_OPS) and ev.key not in labels:
            rest_ops[ev.key] += ev.self_cpu_time_total / 1e3 / steps
    return {"wall_ms_under_profiler": round(wall, 3),
            "top_ops": [{"op": n, "self_ms": round(v, 3)} for n, v in
                        sorted(rest_ops.items(), key=lambda kv: -kv[1])[:8]],
            "self_ms": {k: round(v, 3) for k, v in sorted(parts.items())},
            "ops_per_step": {k: v // steps for k, v in counts.items()},
            "python_gap_ms": gaps,
            "top_linear_ops": [{"part": p, "op": n, "self_ms": round(v, 3)} for (p, n), v in
                               sorted(top.items(), key=lambda kv: -kv[1])[:14]]}


@contextmanager
def decode_path(variant: str):
    """variant "kernel": the C++ decode step where it is built (shoal/layers/ops/
    cpu_linear_state.py); "torch": the torch ops."""
    from shoal.layers.ops import cpu_linear_state

    usable = cpu_linear_state.usable
    if variant == "torch":
        cpu_linear_state.usable = lambda x: False
    try:
        yield
    finally:
        cpu_linear_state.usable = usable


def measure(runner: Any, batch: int, context: int, steps: int, rounds: int,
            profile_steps: int, variants: list[str]) -> dict[str, Any]:
    """Each variant's step time: the median over quiet rounds (variants alternate within each,
    each round waits for a quiet machine) of a round's median step; the split of one more
    round."""
    run_step(runner, decode_schedule(runner, batch, context, first=True))
    sched = decode_schedule(runner, batch, context, first=False)
    per: dict[str, list[float]] = defaultdict(list)
    loads = []
    for r in range(rounds):
        wait_quiet(max_cores=0.2, limit=120)
        load = MachineLoad()
        for v in (variants if r % 2 == 0 else variants[::-1]):
            with decode_path(v):
                timed_steps(runner, sched, 1)
                per[v].append(statistics.median(timed_steps(runner, sched, steps)))
        loads.append(load.result()["other_cores"])
    # rounds a neighbour left alone (under QUIET_CORES busy elsewhere), else all
    quiet = [i for i, c in enumerate(loads) if c < QUIET_CORES] or list(range(rounds))
    out: dict[str, Any] = {"batch": batch, "context": context, "round_other_cores": loads,
                           "quiet_rounds": quiet}
    for v in variants:
        step = statistics.median(per[v][i] for i in quiet)
        wait_quiet(max_cores=0.2, limit=120)
        timers = PartTimers()
        try:
            with decode_path(v):
                timed_steps(runner, sched, steps)
        finally:
            timers.restore()
        split = timers.split(steps)
        out[v] = {"step_median_ms": round(step, 3),
                  "step_min_ms": round(min(per[v][i] for i in quiet), 3),
                  "round_medians_ms": [round(x, 2)
                                                                         for x in per[v]],
                  "tok_s": round(batch * 1e3 / step, 1), "timers": split,
                  "linear_decode_share": round(split["linear_decode_total_ms"] / step, 3)}
        if profile_steps:
            wait_quiet(max_cores=0.2, limit=120)
            with decode_path(v):
                out[v]["profile"] = profile_split(runner, sched, profile_steps)
    if len(variants) == 2:
        a, b = variants
        out[f"{b}_speedup_over_{a}"] = round(out[a]["step_median_ms"]
                                             / out[b]["step_median_ms"], 3)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--batches", type=comma_ints, default=[1, 8])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--steps", type=int, default=5, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="torch,kernel",
                    help="linear decode paths compared: torch, kernel (the C++ step)")
    ap.add_argument("--profile-steps", type=int, default=3)
    ap.add_argument("--engine-args", default="{}", help="JSON of extra LLM(...) arguments")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch

    from shoal import LLM, cpu_kernels
    res: dict[str, Any] = {**provenance(), "torch": torch.__version__, "cpu": cpu_model(),
                           "threads": torch.get_num_threads(),
                           "cpu_layer_ops": cpu_kernels.layer_ops_enabled(),
                           "config": qwen35_small_config(args.vocab), "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(res["config"]))
        for dtype in args.dtypes.split(","):
            llm = LLM(model=tmp, load_format="dummy", dtype=dtype, skip_tokenizer_init=True,
                      max_model_len=2048, kv_cache_memory_bytes=1 << 30,
                      **json.loads(args.engine_args))
            runner = engine_internals.core(llm, required=True).runner
            for batch in args.batches:
                waited = wait_quiet(max_cores=0.2, limit=600)
                load = MachineLoad()
                case = {"dtype": dtype, "waited_for_quiet_s": round(waited, 1), **measure(
                    runner, batch, args.context, args.steps, args.rounds, args.profile_steps,
                    args.variants.split(","))}
                case["load"] = load.result()
                res["cases"].append(case)
                print(json.dumps(case, indent=1), flush=True)
            llm.shutdown()
            del llm, runner
    if args.out:
        write(res, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
