"""GPU benchmarks W1, W2, W3 and W7 (../shared/BENCHMARKS.md) for shoal on random weights of
real shapes, plus transformers' batched figure for W3. One part per invocation, so each can
run in its own process with its own time limit:

    python benchmarks/gpu_suite.py w2 --out results.json
    python benchmarks/gpu_suite.py w1 | w3 | w3-hf | w7
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from gpu_common import record, write

LLAMA_8B = "meta-llama/Llama-3.1-8B"
QWEN3_06B = "Qwen/Qwen3-0.6B"
# W2 roofline (BENCHMARKS.md): about 15.0 GB of weights per token at 4.25 TB/s.
W2_BYTES_PER_TOKEN = 15.0e9
COPY_BANDWIDTH = 4.25e12


# Engine arguments every part shares (set from the command line).
ENGINE_KW: dict = {}


def _llm(model: str, **kw):
    from shoal import LLM

    t0 = time.perf_counter()
    llm = LLM(model, load_format="dummy", dtype="bfloat16", **ENGINE_KW, **kw)
    return llm, time.perf_counter() - t0


def _ids(rng: random.Random, n: int, hi: int) -> dict:
    return {"prompt_token_ids": [rng.randrange(hi) for _ in range(n)]}


def w2(args) -> list[dict]:
    from shoal import SamplingParams

    llm, ready = _llm(LLAMA_8B, max_model_len=4096, max_num_seqs=16)
    rng = random.Random(0)
    prompt = _ids(rng, 128, 128000)
    first = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    full = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
    llm.generate(_ids(rng, 128, 128000), full, use_tqdm=False)  # warm
    runs = []
    for _ in range(3):
        p = _ids(rng, 128, 128000)
        t0 = time.perf_counter()
        llm.generate(p, first, use_tqdm=False)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = llm.generate(prompt, full, use_tqdm=False)[0]
        total = time.perf_counter() - t0
        runs.append((total, ttft, len(out.outputs[0].token_ids)))
    total, ttft, n = sorted(runs)[1]
    decode = (n - 1) / (total - ttft)
    roofline = COPY_BANDWIDTH / W2_BYTES_PER_TOKEN
    # Where a step's time goes: the decode graph alone vs the whole step.
    replay_ms = _time_replay(llm)
    _profile_host(llm, _ids(rng, 128, 128000))
    return [record("W2", "shoal", model=LLAMA_8B, dtype="bfloat16", batch=1,
                   input_len=128, output_len=256, output_tok_s=n / total,
                   decode_tok_s=decode, ttft_s=ttft, roofline_tok_s=roofline,
                   fraction_of_roofline=decode / roofline, ready_s=ready,
                   step_ms=1000 / decode, graph_replay_ms=replay_ms)]


def _time_replay(llm) -> float | None:
    graphs = llm.llm_engine.core.runner.graphs
    if graphs is None or 1 not in graphs.graphs:
        return None
    g = graphs.graphs[1]
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(50):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 50 * 1000


def _profile_host(llm, prompt) -> None:
    """Prints where host time goes in a batch-1 generate (the GPU waits on it)."""
    import cProfile
    import pstats

    from shoal import SamplingParams

    prof = cProfile.Profile()
    prof.enable()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                 use_tqdm=False)
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def w1(args) -> list[dict]:
    from shoal import SamplingParams

    llm, ready = _llm(QWEN3_06B, max_model_len=4096, max_num_seqs=args.max_num_seqs)
    rng = random.Random(0)
    n = args.num_requests
    ins = [rng.randint(100, 1024) for _ in range(n)]
    outs = [rng.randint(100, 1024) for _ in range(n)]
    prompts = [_ids(rng, i, 10000) for i in ins]
    params = [SamplingParams(temperature=0.6, max_tokens=o, ignore_eos=True) for o in outs]
    llm.generate(prompts[:4], params[:4], use_tqdm=False)  # warm
    t0 = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    total = sum(len(r.outputs[0].token_ids) for r in res)
    figures = dict(model=QWEN3_06B, dtype="bfloat16", num_requests=n,
                   total_output_tokens=total, elapsed_s=dt, output_tok_s=total / dt,
                   ready_s=ready, max_num_seqs=args.max_num_seqs)
    if args.split_time:
        figures["step_split"] = _step_split(llm, prompts, params)
    return [record("W1", "shoal", **figures)]


def _step_split(llm, prompts, params) -> dict:
    """Reruns W1 timing each step: wall time of the whole engine step against the GPU time of
    its decode-graph replay (CUDA events), to tell host-bound from device-bound steps."""
    graphs = llm.llm_engine.core.runner.graphs
    events: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
    real_run = graphs.run

    def timed_run(input_ids, *a, **kw):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = real_run(input_ids, *a, **kw)
        end.record()
        events.append((len(input_ids), start, end))
        return out

    graphs.run = timed_run
    eng = llm.llm_engine
    step_walls: list[float] = []
    real_step = eng.step

    def timed_step():
        t = time.perf_counter()
        out = real_step()
        step_walls.append(time.perf_counter() - t)
        return out

    eng.step = timed_step
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    eng.step, graphs.run = real_step, real_run
    gpu = [(b, s.elapsed_time(e)) for b, s, e in events]
    big = [ms for b, ms in gpu if b >= 128]
    return {
        "steps": len(step_walls), "graph_steps": len(gpu),
        "step_wall_ms_mean": 1000 * sum(step_walls) / len(step_walls),
        "graph_gpu_ms_mean": sum(ms for _, ms in gpu) / max(len(gpu), 1),
        "graph_gpu_ms_mean_batch_ge_128": sum(big) / max(len(big), 1),
        "graph_steps_batch_ge_128": len(big),
    }


def w3(args) -> list[dict]:
    from shoal import SamplingParams

    llm, ready = _llm(LLAMA_8B, max_model_len=2048, max_num_seqs=args.max_num_seqs)
    rng = random.Random(0)
    n = args.num_requests
    prompts = [_ids(rng, 1000, 128000) for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    t0 = time.perf_counter()
    res = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    total = sum(len(r.outputs[0].token_ids) for r in res)
    return [record("W3", "shoal", model=LLAMA_8B, dtype="bfloat16", num_requests=n,
                   input_len=1000, output_len=1000, total_output_tokens=total, elapsed_s=dt,
                   output_tok_s=total / dt, ready_s=ready, max_num_seqs=args.max_num_seqs)]


def w3_hf(args) -> list[dict]:
    """transformers generate, batched, on the same shape with random weights (its best batch
    that fits the time limit), as the anchor beside W3."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shoal.loader.resolve import resolve_model

    cfg = AutoConfig.from_pretrained(resolve_model(LLAMA_8B).path)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    out = []
    for bs in args.hf_batches:
        ids = torch.randint(0, 128000, (bs, 1000), device="cuda")
        gen = args.hf_output_len
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


def w7(args) -> list[dict]:
    """Seconds from process start to ready, and the first request's TTFT against steady state."""
    from shoal import SamplingParams

    t_start = args.process_start
    model = {"llama": LLAMA_8B, "qwen3": QWEN3_06B}[args.w7_model]
    llm, _ = _llm(model, max_model_len=4096, max_num_seqs=64)
    ready = time.time() - t_start
    rng = random.Random(1)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ttfts = []
    for _ in range(6):
        t0 = time.perf_counter()
        llm.generate(_ids(rng, 128, 10000), one, use_tqdm=False)
        ttfts.append(time.perf_counter() - t0)
    steady = sorted(ttfts[1:])[2]
    times = llm.llm_engine.core.runner.startup_times
    return [record("W7", "shoal", model=model, dtype="bfloat16", ready_s=ready,
                   first_ttft_s=ttfts[0], steady_ttft_s=steady,
                   first_over_steady=ttfts[0] / steady, startup_stages_s=times)]


def syncs(args) -> list[dict]:
    """Counts host-device synchronisations inside ModelRunner.launch (torch's sync debug
    mode) over a mixed batch: with async scheduling there should be none, since any of them
    makes the host wait for the step in flight."""
    import collections
    import warnings

    from shoal import SamplingParams

    llm, _ = _llm(QWEN3_06B, max_model_len=2048, max_num_seqs=64)
    runner = llm.llm_engine.core.runner
    real = runner.launch
    sites: collections.Counter = collections.Counter()
    launches = 0

    def checked(sched):
        nonlocal launches
        launches += 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return real(sched)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                for w in caught:
                    sites[f"{w.filename}:{w.lineno}"] += 1

    runner.launch = checked
    rng = random.Random(3)
    prompts = [_ids(rng, rng.randint(20, 300), 10000) for _ in range(48)]
    params = [SamplingParams(temperature=[0.0, 0.6, 1.0][i % 3], top_p=0.9 if i % 4 == 1 else 1.0,
                             max_tokens=rng.randint(5, 60), ignore_eos=True,
                             logprobs=2 if i % 5 == 0 else None,
                             seed=i if i % 6 == 0 else None) for i in range(48)]
    llm.generate(prompts, params, use_tqdm=False)
    runner.launch = real
    return [record("sync-check", "shoal", model=QWEN3_06B, launches=launches,
                   sync_sites=dict(sites), output_tok_s=None)]


def main() -> None:
    process_start = time.time()
    ap = argparse.ArgumentParser()
    ap.add_argument("part", choices=["w1", "w2", "w3", "w3-hf", "w7", "syncs"])
    ap.add_argument("--async-scheduling", choices=["on", "off"], default="on")
    ap.add_argument("--out", required=True)
    ap.add_argument("--executor", choices=["uni", "mp"], default="uni",
                    help="distributed_executor_backend (mp at world size 1: the worker path)")
    ap.add_argument("--num-requests", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--hf-batches", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--hf-output-len", type=int, default=100)
    ap.add_argument("--w7-model", default="llama", choices=["llama", "qwen3"])
    ap.add_argument("--split-time", action="store_true",
                    help="W1: rerun timing host and GPU time of every step")
    args = ap.parse_args()
    ENGINE_KW["async_scheduling"] = args.async_scheduling == "on"
    ENGINE_KW["distributed_executor_backend"] = args.executor
    args.process_start = float(__import__("os").environ.get("SHOAL_PROCESS_START", process_start))
    defaults = {"w1": 256, "w3": 1024}
    if args.num_requests is None:
        args.num_requests = defaults.get(args.part, 1)
    fn = {"w1": w1, "w2": w2, "w3": w3, "w3-hf": w3_hf, "w7": w7, "syncs": syncs}[args.part]
    records = fn(args)
    for r in records:
        r.setdefault("async_scheduling", ENGINE_KW["async_scheduling"])
        r.setdefault("executor", args.executor)
        print(r, flush=True)
    write(records, args.out)


if __name__ == "__main__":
    main()
