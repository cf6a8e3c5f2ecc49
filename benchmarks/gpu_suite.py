"""GPU benchmarks W1, W2 and W7 (../shared/BENCHMARKS.md) for shoal on random weights of real
shapes, transformers' batched figure beside W3, and a check for host-device syncs. One part
per invocation, so each runs in its own process with its own time limit:

    python benchmarks/gpu_suite.py w2 --out results.json
    python benchmarks/gpu_suite.py w1 | w3-hf | w7 | syncs --out FILE
    python benchmarks/gpu_suite.py w1 --smoke --out /tmp/w1.json   # tiny model on the CPU
    python benchmarks/gpu_suite.py w2 --model-impl transformers --out FILE  # the backend

W3 itself is `shoal bench throughput --preset W3`. Every record has ready_s (LLM(...) alone)
and process_ready_s (from process start: W7's figure), model_impl (--model-impl: auto, shoal's
own class, or the Transformers backend on the same shape), model_class (the class that ran:
TransformersForCausalLM for the backend) and cuda_graphs (whether the engine kept its CUDA
graphs: the backend drops them when its forward fails the start-up check); those two are None
where engine internals are off."""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import engine_internals
import offline_runs
from bench_args import REQUIRED, add_common
from offline_runs import LLAMA_8B, QWEN3_06B
from results_file import record, write

# W2 roofline (BENCHMARKS.md): about 15.0 GB of weights per token at 4.25 TB/s.
W2_BYTES_PER_TOKEN = 15.0e9
FULL = dict(w1_in=(100, 1024), w1_out=(100, 1024), w1_requests=256, b1_in=128, b1_out=256,
            max_model_len=4096, dtype="bfloat16", vocab=128000, device=None)
SMOKE = dict(w1_in=(8, 40), w1_out=(4, 16), w1_requests=6, b1_in=16, b1_out=12,
             max_model_len=512, dtype="float32", vocab=512, device="cpu")


class Suite:
    """The parts' shared settings: engine arguments from the flags, full or smoke sizes."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.sizes = SMOKE if args.smoke else FULL
        self.engine_kw: dict[str, Any] = {
            "load_format": "dummy", "dtype": self.sizes["dtype"],
            "async_scheduling": args.async_scheduling == "on",
            "distributed_executor_backend": args.executor}
        if args.model_impl != "auto":  # (left out by default: trees before the backend)
            self.engine_kw["model_impl"] = args.model_impl
        if args.smoke:
            self.engine_kw |= {"device": "cpu", "kv_cache_memory_bytes": 64 << 20}
            self.tiny = offline_runs.tiny_llama(Path(tempfile.mkdtemp(prefix="suite-smoke-")))

    def model(self, name: str) -> str:
        return self.tiny if self.args.smoke else name

    def start(self, name: str, **kw: Any) -> offline_runs.Engine:
        return offline_runs.start_engine(self.model(name), **self.engine_kw, **kw)

    def common(self, engine: offline_runs.Engine, name: str) -> dict[str, Any]:
        runner = engine_internals.runner(engine.llm)
        return dict(model=name, dtype=self.sizes["dtype"], ready_s=engine.ready_s,
                    process_ready_s=engine.process_ready_s, smoke=self.args.smoke,
                    model_impl=self.args.model_impl,
                    model_class=None if runner is None
                    else type(getattr(runner, "model", None)).__name__,
                    cuda_graphs=None if runner is None
                    else getattr(runner, "graphs", None) is not None)


def w2(s: Suite) -> list[dict]:
    sz = s.sizes
    eng = s.start(LLAMA_8B, max_model_len=sz["max_model_len"], max_num_seqs=16)
    fig = offline_runs.batch1(eng.llm, sz["vocab"], sz["b1_in"], sz["b1_out"],
                              repeat_prompt=True)
    roofline = offline_runs.copy_bandwidth() / W2_BYTES_PER_TOKEN
    # Where a step's time goes: the decode graph alone vs the whole step.
    replay_ms = engine_internals.graph_replay_ms(eng.llm)
    if not s.args.no_profile:
        _profile_host(eng.llm, sz["vocab"], sz["b1_in"])
    return [record("W2", "shoal", **s.common(eng, LLAMA_8B), batch=1, input_len=sz["b1_in"],
                   output_len=sz["b1_out"], **fig, roofline_tok_s=roofline,
                   fraction_of_roofline=(fig["decode_tok_s"] or 0) / roofline,
                   graph_replay_ms=replay_ms)]


def _profile_host(llm: Any, vocab: int, input_len: int) -> None:
    """Prints where host time goes in a batch-1 generate (the GPU waits on it)."""
    import cProfile
    import pstats
    import random

    from shoal import SamplingParams

    prof = cProfile.Profile()
    prof.enable()
    llm.generate(offline_runs.random_prompt(random.Random(9), input_len, vocab),
                 SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def w1(s: Suite) -> list[dict]:
    sz, n = s.sizes, s.args.num_requests or s.sizes["w1_requests"]
    eng = s.start(QWEN3_06B, max_model_len=sz["max_model_len"], max_num_seqs=s.args.max_num_seqs)
    prompts, params, _, _ = offline_runs.w1_requests(n, min(10000, sz["vocab"]),
                                                     in_range=sz["w1_in"], out_range=sz["w1_out"])
    figures = dict(**s.common(eng, QWEN3_06B), num_requests=n,
                   **offline_runs.throughput(eng.llm, prompts, params, s.args.num_runs),
                   max_num_seqs=s.args.max_num_seqs)
    if s.args.split_time:
        figures["step_split"] = _step_split(eng.llm, prompts, params)
    return [record("W1", "shoal", **figures)]


def _step_split(llm: Any, prompts: list, params: list) -> dict | None:
    """Reruns W1 timing each step: wall time of the whole engine step against the GPU time of
    its decode-graph replay (CUDA events), to tell host-bound from device-bound steps."""
    import torch

    core = engine_internals.core(llm, required=True)
    graphs = core.runner.graphs
    if graphs is None:  # (the engine runs eagerly: nothing to split)
        return None
    events: list[tuple[int, Any, Any]] = []
    real_run, timers = graphs.run, engine_internals.MethodTimers()

    def timed_run(*a, **kw):  # (shape, inputs, fill) since the seams refactor
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = real_run(*a, **kw)
        end.record()
        rows = len(a[0]) if isinstance(a[0], list) else len(a[1].items)
        events.append((rows, start, end))
        return out

    graphs.run = timed_run
    timers.wrap(llm.llm_engine, "step")  # internal, as core() is
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    graphs.run = real_run
    timers.restore()
    step_walls = timers.calls["step"]
    gpu = [(b, st.elapsed_time(e)) for b, st, e in events]
    big = [ms for b, ms in gpu if b >= 128]
    return {"steps": len(step_walls), "graph_steps": len(gpu),
            "step_wall_ms_mean": 1000 * sum(step_walls) / max(len(step_walls), 1),
            "graph_gpu_ms_mean": sum(ms for _, ms in gpu) / max(len(gpu), 1),
            "graph_gpu_ms_mean_batch_ge_128": sum(big) / max(len(big), 1),
            "graph_steps_batch_ge_128": len(big)}


def w3_hf(s: Suite) -> list[dict]:
    """transformers generate, batched, on the W3 shape with random weights (its best batch
    that fits the time limit), as the anchor beside `shoal bench throughput --preset W3`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(offline_runs.shipped_folder(LLAMA_8B))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    out = []
    for bs in s.args.hf_batches:
        ids = torch.randint(0, 128000, (bs, 1000), device="cuda")
        gen = s.args.hf_output_len
        model.generate(ids[:, :16], max_new_tokens=4, min_new_tokens=4, do_sample=False)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        res = model.generate(ids, max_new_tokens=gen, min_new_tokens=gen, do_sample=False,
                             pad_token_id=0)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        new = (res.shape[1] - 1000) * bs
        out.append(record("W3", "transformers", model=LLAMA_8B, dtype="bfloat16", batch=bs,
                          input_len=1000, output_len=gen, total_output_tokens=new,
                          elapsed_s=dt, output_tok_s=new / dt,
                          note="generate, eager, dynamic cache; output length reduced to fit"))
        print(out[-1], flush=True)
    return out


def w7(s: Suite) -> list[dict]:
    """Seconds from process start to ready, and the first request's TTFT against steady state."""
    import random

    from shoal import SamplingParams

    name = {"llama": LLAMA_8B, "qwen3": QWEN3_06B}[s.args.w7_model]
    eng = s.start(name, max_model_len=s.sizes["max_model_len"], max_num_seqs=64)
    rng = random.Random(1)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ttfts = []
    for _ in range(6):
        t0 = time.perf_counter()
        eng.llm.generate(offline_runs.random_prompt(rng, 128, min(10000, s.sizes["vocab"])),
                         one, use_tqdm=False)
        ttfts.append(time.perf_counter() - t0)
    steady = sorted(ttfts[1:])[2]
    # W7's ready_s is from process start; LLM(...) alone is engine_ready_s here.
    fig = s.common(eng, name) | {"ready_s": eng.process_ready_s, "engine_ready_s": eng.ready_s}
    return [record("W7", "shoal", **fig, first_ttft_s=ttfts[0], steady_ttft_s=steady,
                   first_over_steady=ttfts[0] / steady,
                   startup_stages_s=engine_internals.startup_stages(eng.llm))]


def syncs(s: Suite) -> list[dict]:
    """Counts host-device synchronisations inside the runner's launch (torch's sync debug
    mode) over a mixed batch: with async scheduling there should be none, since any of them
    makes the host wait for the step in flight."""
    import collections
    import random
    import warnings

    import torch

    from shoal import SamplingParams

    eng = s.start(QWEN3_06B, max_model_len=2048, max_num_seqs=64)
    runner = engine_internals.core(eng.llm, required=True).runner
    # The runner's launch (before the seams refactor) or its execute and sample.
    names = ["launch"] if hasattr(runner, "launch") else ["execute", "sample"]
    reals = {name: getattr(runner, name) for name in names}
    sites: collections.Counter = collections.Counter()
    launches = 0

    def checked(name, *args):
        nonlocal launches
        launches += name != "sample"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return reals[name](*args)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                for w in caught:
                    sites[f"{name} {w.filename}:{w.lineno}"] += 1

    for name in names:
        setattr(runner, name, lambda *a, name=name: checked(name, *a))
    rng = random.Random(3)
    prompts = [offline_runs.random_prompt(rng, rng.randint(20, 300), 10000) for _ in range(48)]
    params = [SamplingParams(temperature=[0.0, 0.6, 1.0][i % 3], top_p=0.9 if i % 4 == 1 else 1.0,
                             max_tokens=rng.randint(5, 60), ignore_eos=True,
                             logprobs=2 if i % 5 == 0 else None,
                             seed=i if i % 6 == 0 else None) for i in range(48)]
    eng.llm.generate(prompts, params, use_tqdm=False)
    for name in names:
        delattr(runner, name)  # the class's methods again
    return [record("sync-check", "shoal", model=QWEN3_06B, launches=launches,
                   sync_sites=dict(sites), output_tok_s=None)]


PARTS = {"w1": w1, "w2": w2, "w3-hf": w3_hf, "w7": w7, "syncs": syncs}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=list(PARTS))
    add_common(ap, out=REQUIRED, num_requests=None, max_num_seqs=256,
               smoke="a 2-layer Llama on the CPU, float32, short requests")
    ap.add_argument("--async-scheduling", choices=["on", "off"], default="on")
    ap.add_argument("--executor", choices=["uni", "mp"], default="uni",
                    help="distributed_executor_backend (mp at world size 1: the worker path)")
    ap.add_argument("--num-runs", type=int, default=1,
                    help="W1: timed runs in a row (first against later runs shows warm-up)")
    ap.add_argument("--no-profile", action="store_true", help="W2: skip the host profile")
    ap.add_argument("--hf-batches", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--hf-output-len", type=int, default=100)
    ap.add_argument("--w7-model", default="llama", choices=["llama", "qwen3"])
    ap.add_argument("--split-time", action="store_true",
                    help="W1: rerun timing host and GPU time of every step")
    ap.add_argument("--model-impl", choices=["auto", "shoal", "transformers"], default="auto",
                    help="shoal's own model class or the Transformers backend, on the same "
                         "shape (W1/W2: the backend against native)")
    args = ap.parse_args(argv)
    records = PARTS[args.part](Suite(args))
    for r in records:
        r.setdefault("async_scheduling", args.async_scheduling == "on")
        r.setdefault("executor", args.executor)
        print(r, flush=True)
    write(records, args.out)
    return records


if __name__ == "__main__":
    main()
