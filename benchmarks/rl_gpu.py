"""Engines inside training loops on one GPU (written for an H200): the Llama-3.1-8B shape
(load_format=dummy), GPU memory after sleep level 1 and 2 from the CUDA allocator's counters
(torch.cuda.memory_allocated / memory_reserved, and the device's used memory from
torch.cuda.mem_get_info), sleep and wake times, the time of a full weight update from a dict of
device tensors and its bandwidth, and N sleep / update / wake / generate cycles with the
allocator's figures after each (growth would show).

With --offload-gb 0,4,8 also weight offloading (cpu_offload_gb): for each budget a fresh
engine, its offloaded layers and bytes, and
- batch1: greedy decode tok/s (128 prompt tokens; the time of 1+N tokens less that of 1)
  against the floor of a step that copies the offloaded bytes over the host link (measured:
  one pinned 1 GiB host-to-device copy) and reads every weight from device memory
  (offline_runs.copy_bandwidth());
- w1: output tok/s of W1's 256 requests (offline_runs.w1_requests, one generate, after a
  short warm-up) and the forward passes it took. Every forward copies the offloaded bytes
  once, so link_s = forwards * offloaded_bytes / h2d; compute_s is the same run's time on
  the engine without offloading (budget 0, which the list must hold). With the
  copies hidden behind compute (prefetch), the floor is max(compute_s, link_s); serial_s =
  compute_s + link_s is what no overlap at all would give.
--offload-prefetch on|off|both picks weight offloading's prefetch (layer i+1 copied on a
side stream while layer i computes: shoal/loader/offload_copies.py); --offload-parts picks
batch1 and/or w1; --skip-lifecycle runs the offload part alone.

    python benchmarks/rl_gpu.py --out bench-work/rl-h200.json [--cycles 20]
    python benchmarks/rl_gpu.py --skip-lifecycle --offload-gb 0,4,8 --out bench-work/off.json
    python benchmarks/rl_gpu.py --smoke --out /tmp/rl.json      # CPU, tiny model
    python benchmarks/rl_gpu.py --smoke --offload-gb 0,1 --out /tmp/rl.json  # (tiny budgets)"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path
from typing import Any

import offline_runs
from results_file import record, write


def memory() -> dict[str, float]:
    import torch

    if not torch.cuda.is_available():
        return {}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {"allocated_gib": torch.cuda.memory_allocated() / 2**30,
            "reserved_gib": torch.cuda.memory_reserved() / 2**30,
            "device_used_gib": (total - free) / 2**30}


def checkpoint_named(model: Any) -> dict[str, Any]:
    """A Llama's parameters under their checkpoint names (one rank): the fused q|k|v and
    gate|up split back into their projections."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach().clone()
        if ".qkv_proj." in name:
            attn = model.get_submodule(name.rsplit(".", 2)[0])
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split(sizes)):
                out[name.replace("qkv_proj", part)] = piece
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), t.chunk(2)):
                out[name.replace("gate_up_proj", part)] = piece
        else:
            out[name] = t
    return out


def h2d_bandwidth() -> float | None:
    """Bytes/s of one pinned 1 GiB host-to-device copy (best of 3); None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    host = torch.empty(2**30, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return host.numel() / best


def timed(llm: Any, prompt: dict[str, Any], tokens: int) -> tuple[float, list[int]]:
    from shoal import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    t0 = time.perf_counter()
    out = llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids
    return time.perf_counter() - t0, list(out)


def offload_run(model: str, gb: float, kw: dict[str, Any], n: int, link: float | None,
                parts: set[str], w1: int) -> tuple[dict[str, Any], list[int]]:
    """One engine with cpu_offload_gb=gb: its figures and its greedy batch-1 tokens."""
    from shoal import LLM
    from shoal.loader.weight_offload import offloader_of

    llm = LLM(model, cpu_offload_gb=gb, **kw)
    try:
        runner = llm.llm_engine.core.runner
        offloader = offloader_of(runner.model)
        stats = offloader.stats if offloader is not None else None
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        offloaded = stats.offloaded_bytes if stats else 0
        fig: dict[str, Any] = {
            "cpu_offload_gb": gb, "prefetch": offloader.prefetch if offloader else None,
            "offloaded_layers": len(stats.layers) if stats else 0,
            "offloaded_bytes": offloaded, "staging_bytes": stats.staging_bytes if stats else 0,
            "weight_bytes": weight_bytes, "kv_blocks": runner.null_block}
        tokens: list[int] = []
        if "batch1" in parts:
            prompt = {"prompt_token_ids": list(range(100, 228))}
            timed(llm, prompt, n + 1)  # warm-up
            first = min(timed(llm, prompt, 1)[0] for _ in range(3))
            full, tokens = min((timed(llm, prompt, n + 1) for _ in range(3)),
                               key=lambda r: r[0])
            floor_s = (weight_bytes / offline_runs.copy_bandwidth()
                       + (offloaded / link if link else 0.0))
            fig |= {"decode_tok_s": n / (full - first), "floor_tok_s": 1 / floor_s}
        if "w1" in parts:
            fig["w1"] = w1_run(llm, runner, w1, offloaded, link)
        return {**fig, **memory()}, tokens
    finally:
        llm.shutdown()


def w1_run(llm: Any, runner: Any, n: int, offloaded: int, link: float | None
           ) -> dict[str, Any]:
    """W1's n requests in one generate (after 4 requests of 4 tokens: a warm-up of W1's own
    length would take as many offloaded steps as the run), and the forward passes they took."""
    from shoal import SamplingParams

    vocab = runner.vocab_size
    small = vocab < 10000  # (--smoke: the tiny model, short requests)
    prompts, params, _, _ = offline_runs.w1_requests(
        n, hi=min(10000, vocab), **(dict(in_range=(8, 32), out_range=(4, 16)) if small
                                    else {}))
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    offline_runs.sync()
    forwards = runner.num_forwards
    t0 = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    forwards = runner.num_forwards - forwards
    total = sum(len(r.outputs[0].token_ids) for r in out)
    return {"requests": n, "total_output_tokens": total, "elapsed_s": elapsed,
            "output_tok_s": total / elapsed, "forwards": forwards,
            "link_s": forwards * offloaded / link if link else None}


def w1_floors(runs: list[dict[str, Any]]) -> None:
    """Each offloaded run's W1 floor from the run without offloading (its compute_s)."""
    plain = next((r["w1"] for r in runs if "w1" in r and not r["offloaded_bytes"]), None)
    for r in runs:
        w1 = r.get("w1")
        if w1 is None or plain is None or w1["link_s"] is None:
            continue
        compute, link, total = plain["elapsed_s"], w1["link_s"], w1["total_output_tokens"]
        floor = max(compute, link)
        w1 |= {"compute_s": compute, "floor_s": floor, "serial_s": compute + link,
               "floor_tok_s": total / floor, "serial_tok_s": total / (compute + link),
               "of_floor": floor / w1["elapsed_s"]}


def offload_decode(model: str, budgets: list[float], kw: dict[str, Any], smoke: bool,
                   prefetch: list[bool], parts: set[str], w1: int) -> dict[str, Any]:
    """Each cpu_offload_gb (a fresh engine each, and one per prefetch setting where layers
    are offloaded), its offload report, batch-1 decode and W1 against their floors. On the
    CPU (--smoke) the tests' hook runs the mechanism, budgets then in MiB."""
    from shoal.engine.offload_args import WeightOffloadArgs
    from shoal.loader.weight_offload import WeightOffloader

    if smoke:
        WeightOffloadArgs.offload_on_cpu = True
    link = h2d_bandwidth()
    n = 8 if smoke else 128
    runs, first_tokens = [], None
    for gb in budgets:
        for setting in prefetch if gb else prefetch[:1]:
            WeightOffloader.default_prefetch = setting
            try:
                fig, tokens = offload_run(model, gb / 1024 if smoke else gb, kw, n, link,
                                          parts, w1)
            finally:
                WeightOffloader.default_prefetch = None
            first_tokens = tokens if first_tokens is None else first_tokens
            runs.append({**fig, "same_tokens_as_first": (tokens == first_tokens
                                                         if "batch1" in parts else None)})
            release()
    w1_floors(runs)
    return {"h2d_bytes_per_s": link, "copy_bandwidth": offline_runs.copy_bandwidth(),
            "decode_tokens": n, "runs": runs,
            "floor_rule": "weight_bytes / copy_bandwidth + offloaded_bytes / h2d_bytes_per_s",
            "w1_floor_rule": "max(compute_s, link_s): compute_s = W1's time without "
                             "offloading, link_s = forwards * offloaded_bytes / "
                             "h2d_bytes_per_s; serial_s = compute_s + link_s (no overlap)"}


def release() -> None:
    """What a shut-down engine held on the device, back to the driver."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=offline_runs.LLAMA_8B)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--offload-gb", default="",
                    help="comma list of cpu_offload_gb values for the offload part (e.g. 0,4,8)")
    ap.add_argument("--offload-prefetch", choices=("on", "off", "both"), default="on",
                    help="weight offloading's prefetch of the next layer (both: an engine "
                         "each, prefetch first)")
    ap.add_argument("--offload-parts", default="batch1,w1",
                    help="comma list of the offload part's measurements: batch1, w1")
    ap.add_argument("--w1-requests", type=int, default=256)
    ap.add_argument("--skip-lifecycle", action="store_true")
    args = ap.parse_args()
    parts = set(args.offload_parts.split(","))
    if not parts or parts - {"batch1", "w1"}:
        ap.error(f"--offload-parts: batch1 and/or w1 (got {args.offload_parts!r})")
    if args.w1_requests < 4:
        ap.error(f"--w1-requests must be >= 4 (got {args.w1_requests})")
    model = args.model if not args.smoke else offline_runs.tiny_llama(Path(tempfile.mkdtemp()))
    kw: dict[str, Any] = (dict(load_format="dummy", max_model_len=4096,
                               gpu_memory_utilization=0.6) if not args.smoke else
                          dict(load_format="dummy", device="cpu", max_model_len=512))
    records = []
    if not args.skip_lifecycle:
        records.append(lifecycle(args, model, kw))
        release()
    if args.offload_gb:
        budgets = [float(v) for v in args.offload_gb.split(",")]
        prefetch = {"on": [True], "off": [False], "both": [True, False]}[args.offload_prefetch]
        w1 = args.w1_requests if not args.smoke else min(args.w1_requests, 16)
        records.append(record("rl_weight_offload", "shoal", model=args.model,
                              **offload_decode(model, budgets, kw, args.smoke, prefetch,
                                               parts, w1)))
    write(records, args.out)
    return 0


def lifecycle(args: argparse.Namespace, model: str, kw: dict[str, Any]) -> dict[str, Any]:
    import torch

    from shoal import LLM, SamplingParams

    llm = LLM(model, **kw)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 228))}

    def generate() -> list[int]:
        return llm.generate(prompt, sp, use_tqdm=False)[0].outputs[0].token_ids

    fig: dict[str, Any] = {"awake": memory()}
    before = generate()
    runner = llm.llm_engine.core.runner
    weights = checkpoint_named(runner.model)
    weight_bytes = sum(t.numel() * t.element_size() for t in weights.values())
    # (this script's own device copy of the weights, kept for the updates, is in every
    # allocator figure from here on: the engine's share is the figure minus it)
    fig["script_weight_copy_gib"] = weight_bytes / 2**30
    for level in (1, 2):
        t0 = time.perf_counter()
        freed = llm.sleep(level)
        fig[f"sleep{level}_s"] = time.perf_counter() - t0
        fig[f"sleep{level}_freed"] = freed
        fig[f"asleep{level}"] = memory()
        t0 = time.perf_counter()
        llm.wake_up(["weights"])
        if level == 2:
            t1 = time.perf_counter()
            llm.update_weights(weights.items())
            fig["update_after_level2_s"] = time.perf_counter() - t1
        llm.wake_up(["kv_cache"])
        fig[f"wake{level}_s"] = time.perf_counter() - t0
        fig[f"awake_after{level}"] = memory()
        fig[f"same_tokens_after{level}"] = generate() == before
    t0 = time.perf_counter()
    llm.update_weights(weights)
    dt = time.perf_counter() - t0
    fig["update_from_device_dict_s"] = dt
    fig["update_bytes"] = weight_bytes
    fig["update_gb_s"] = weight_bytes / dt / 1e9
    cycles = []
    for _ in range(args.cycles if not args.smoke else 2):
        t0 = time.perf_counter()
        slept = llm.sleep(1)
        llm.wake_up()
        llm.update_weights(weights.items())
        ok = generate() == before
        # (level 1's pinned host buffers are kept from the first cycle's sleep on: no new
        # ones, the same bytes)
        cycles.append({"s": time.perf_counter() - t0, "same_tokens": ok,
                       "host_buffers_allocated": slept["host_buffers_allocated"],
                       "host_copy_bytes": llm.collective_rpc("rank_info")[0]["host_copy_bytes"],
                       **memory()})
    fig["cycles"] = cycles
    llm.shutdown()
    del torch
    return record("rl_lifecycle", "shoal", model=args.model, dtype=str(runner.dtype),
                  weight_bytes=weight_bytes, **fig)


if __name__ == "__main__":
    raise SystemExit(main())
