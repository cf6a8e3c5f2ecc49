"""Where an EAGLE-3 drafter's time goes in W9's engine (spec_decode_gpu.py --methods eagle3):
Llama-3.1-8B shape, random bf16 weights, a random EAGLE-3 head (draft vocabulary 32000), k
drafts, the forced acceptance rate. Per engine step, averaged over one timed generate:

    host ms  of the drafter's parts (perf_counter): on_launch (the fc, queued at launch; with
             mirror graphs a copy of the aux rows), an eager mirror's pass (mirror_pass)
             and _propose (draft 1's pick, the draft graphs' staging and replays, the one
             .tolist() wait), inside it the draft graphs' run (stage + replays); a graphed
             mirror (graph_path: mirror_graphs.py, the mirror and draft 1 as one replay
             feeding the draft graphs, then their replays and the one wait), inside it
             mirror_graphs_run (stage, gather, replay), draft_graphs_stage and
             draft_graphs_replay (also counted inside an eager proposal's run)
    device ms of the same parts (CUDA events around them, read after the run)
    counts   mirror passes, draft-graph runs, eager greedy steps (graphs not captured for
             the batch), CUDA kernels per step (torch.profiler over a short second run)

    python benchmarks/eagle3_step_profile.py --out /tmp/e3prof.json
    python benchmarks/eagle3_step_profile.py --smoke --out /tmp/e3prof.json   # CPU, tiny model

Writes one JSON object: {"batch": {"rate": {...figures...}}}."""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import engine_internals
import offline_runs
import spec_methods
from bench_args import REQUIRED, add_common, comma_floats, comma_ints
from offline_runs import LLAMA_8B


class Phases:
    """Host seconds, CUDA event pairs and call counts of wrapped methods."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.host: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.events: dict[str, list[Any]] = defaultdict(list)

    def wrap(self, obj: Any, attr: str, name: str, when: Any = None) -> None:
        import torch

        inner = getattr(obj, attr)

        def timed(*args: Any, **kw: Any) -> Any:
            if when is not None and not when():
                return inner(*args, **kw)
            start = end = None
            if self.cuda:
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kw)
            finally:
                self.host[name] += time.perf_counter() - t0
                self.calls[name] += 1
                if self.cuda:
                    end.record()
                    self.events[name].append((start, end))
        setattr(obj, attr, timed)

    def figures(self, steps: int) -> dict[str, Any]:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        out: dict[str, Any] = {"steps": steps}
        for name in sorted(self.calls):
            fig = {"calls": self.calls[name], "host_ms_per_step": self.host[name] / steps * 1e3}
            if self.events[name]:
                fig["device_span_ms_per_step"] = sum(
                    s.elapsed_time(e) for s, e in self.events[name]) / steps
            out[name] = {k: round(v, 4) if isinstance(v, float) else v for k, v in fig.items()}
        return out


def profile_rate(llm: Any, prompts: list[dict], sp: Any, cuda: bool) -> dict[str, Any]:
    drafter = engine_internals.runner(llm).drafter
    phases = Phases(cuda)
    proposing = [False]
    saved = {a: getattr(drafter, a) for a in ("on_launch", "mirror_and_propose", "_propose",
                                               "_run_depth", "_greedy_steps",
                                               "_mirror_through_graph")}
    graphs, mirror = drafter.graphs, getattr(drafter, "mirror_graphs", None)
    saved_graphs = {a: getattr(graphs, a) for a in ("run", "stage", "replay")} if graphs else {}
    saved_mirror = mirror.run if mirror is not None else None

    def propose(*args: Any) -> Any:
        proposing[0] = True
        try:
            return saved["_propose"](*args)
        finally:
            proposing[0] = False
    drafter._propose = propose
    phases.wrap(drafter, "on_launch", "on_launch")
    phases.wrap(drafter, "mirror_and_propose", "mirror_and_propose")
    phases.wrap(drafter, "_propose", "propose")
    phases.wrap(drafter, "_run_depth", "mirror_pass", when=lambda: not proposing[0])
    phases.wrap(drafter, "_greedy_steps", "greedy_steps")
    phases.wrap(drafter, "_mirror_through_graph", "graph_path")
    if graphs is not None:
        phases.wrap(graphs, "run", "draft_graphs_run")
        phases.wrap(graphs, "stage", "draft_graphs_stage")
        phases.wrap(graphs, "replay", "draft_graphs_replay")
    if mirror is not None:
        phases.wrap(mirror, "run", "mirror_graphs_run")
    with engine_internals.step_counter(llm) as steps:
        before = steps[0]
        offline_runs.sync()
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        offline_runs.sync()
        wall = time.perf_counter() - t0
        n = steps[0] - before
    out = phases.figures(n)
    out["ms_per_step"] = round(wall / n * 1e3, 4)
    for attr, fn in saved.items():
        setattr(drafter, attr, fn)
    for attr, fn in saved_graphs.items():
        setattr(graphs, attr, fn)
    if mirror is not None:
        mirror.run = saved_mirror
    out["kernels_per_step"] = _kernels_per_step(llm, prompts, cuda)
    return out


def _kernels_per_step(llm: Any, prompts: list[dict], cuda: bool) -> float | None:
    """CUDA kernels launched per engine step over a 32-token run (None on the CPU)."""
    if not cuda:
        return None
    from torch.profiler import ProfilerActivity, profile

    from shoal import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    with engine_internals.step_counter(llm) as steps:
        before = steps[0]
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, sp, use_tqdm=False)
            offline_runs.sync()
        n = steps[0] - before
    kernels = sum(1 for e in prof.events() if e.device_type.name == "CUDA")
    return round(kernels / max(n, 1), 1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common(p, out=REQUIRED, model=LLAMA_8B, load_format="dummy", dtype="bfloat16",
               repeats=1, device=None, smoke="a 2-layer Llama on the CPU (float32)")
    p.add_argument("--batch-sizes", type=comma_ints, default=[1, 32])
    p.add_argument("--rates", type=comma_floats, default=[0.0, 1.0])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--method", choices=("eagle3", "eagle3_confidence"), default="eagle3")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch_sizes, args.input_len, args.output_len = [1, 4], 16, 48
        args.dtype, args.device = "float32", args.device or "cpu"
        if args.model == LLAMA_8B:
            args.model = offline_runs.tiny_llama(Path(tempfile.mkdtemp(prefix="e3-smoke-")))
    from shoal import SamplingParams

    eng = offline_runs.start_engine(args.model, **spec_methods.engine_kwargs(args, args.method))
    cuda = args.device != "cpu"
    vocab = engine_internals.vocab_size(eng.llm) or 32000
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    result: dict[str, Any] = {}
    for batch in args.batch_sizes:
        rng = random.Random(batch)
        prompts = [offline_runs.random_prompt(rng, args.input_len, vocab, lo=100)
                   for _ in range(batch)]
        eng.llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False)  # warm this batch size
        for rate in args.rates:
            spec_methods.set_rate(eng.llm, args.method, rate)
            fig = profile_rate(eng.llm, prompts, sp, cuda)
            result.setdefault(str(batch), {})[str(rate)] = fig
            print(f"batch {batch} rate {rate}: {json.dumps(fig)}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
