"""Engines inside training loops on one GPU (written for an H200): the Llama-3.1-8B shape
(load_format=dummy), GPU memory after sleep level 1 and 2 from the CUDA allocator's counters
(torch.cuda.memory_allocated / memory_reserved, and the device's used memory from
torch.cuda.mem_get_info), sleep and wake times, the time of a full weight update from a dict of
device tensors and its bandwidth, and N sleep / update / wake / generate cycles with the
allocator's figures after each (growth would show).

With --offload-gb 0,4,8 also weight offloading (cpu_offload_gb): for each budget a fresh
engine, its offloaded layers and bytes, and batch-1 greedy decode tok/s (128 prompt tokens;
the time of 1+N tokens less that of 1) against the floor of a step that copies the offloaded
bytes over the host link (measured: one pinned 1 GiB host-to-device copy) and reads every
weight from device memory (offline_runs.copy_bandwidth()); --skip-lifecycle runs that part alone.

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


def offload_run(model: str, gb: float, kw: dict[str, Any], n: int, link: float | None
                ) -> tuple[dict[str, Any], list[int]]:
    """One engine with cpu_offload_gb=gb: its figures and its greedy tokens."""
    from shoal import LLM
    from shoal.loader.weight_offload import offloader_of

    llm = LLM(model, cpu_offload_gb=gb, **kw)
    try:
        runner = llm.llm_engine.core.runner
        offloader = offloader_of(runner.model)
        stats = offloader.stats if offloader is not None else None
        prompt = {"prompt_token_ids": list(range(100, 228))}
        timed(llm, prompt, n + 1)  # warm-up
        first = min(timed(llm, prompt, 1)[0] for _ in range(3))
        full, tokens = min((timed(llm, prompt, n + 1) for _ in range(3)), key=lambda r: r[0])
        weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        offloaded = stats.offloaded_bytes if stats else 0
        floor_s = (weight_bytes / offline_runs.copy_bandwidth()
                   + (offloaded / link if link else 0.0))
        return {"cpu_offload_gb": gb, "offloaded_layers": len(stats.layers) if stats else 0,
                "offloaded_bytes": offloaded,
                "staging_bytes": stats.staging_bytes if stats else 0,
                "weight_bytes": weight_bytes, "kv_blocks": runner.null_block,
                "decode_tok_s": n / (full - first), "floor_tok_s": 1 / floor_s,
                **memory()}, tokens
    finally:
        llm.shutdown()


def offload_decode(model: str, budgets: list[float], kw: dict[str, Any], smoke: bool
                   ) -> dict[str, Any]:
    """Batch-1 decode with each cpu_offload_gb (a fresh engine each), its offload report and
    floor. On the CPU (--smoke) the tests' hook runs the mechanism, budgets then in MiB."""
    from shoal.engine.offload_args import WeightOffloadArgs

    if smoke:
        WeightOffloadArgs.offload_on_cpu = True
    link = h2d_bandwidth()
    n = 8 if smoke else 128
    runs, first_tokens = [], None
    for gb in budgets:
        fig, tokens = offload_run(model, gb / 1024 if smoke else gb, kw, n, link)
        first_tokens = tokens if first_tokens is None else first_tokens
        runs.append({**fig, "same_tokens_as_first": tokens == first_tokens})
        release()
    return {"h2d_bytes_per_s": link, "copy_bandwidth": offline_runs.copy_bandwidth(),
            "decode_tokens": n, "runs": runs,
            "floor_rule": "weight_bytes / copy_bandwidth + offloaded_bytes / h2d_bytes_per_s"}


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
    ap.add_argument("--skip-lifecycle", action="store_true")
    args = ap.parse_args()
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
        records.append(record("rl_weight_offload", "shoal", model=args.model,
                              **offload_decode(model, budgets, kw, args.smoke)))
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
        llm.sleep(1)
        llm.wake_up()
        llm.update_weights(weights.items())
        ok = generate() == before
        cycles.append({"s": time.perf_counter() - t0, "same_tokens": ok, **memory()})
    fig["cycles"] = cycles
    llm.shutdown()
    del torch
    return record("rl_lifecycle", "shoal", model=args.model, dtype=str(runner.dtype),
                  weight_bytes=weight_bytes, **fig)


if __name__ == "__main__":
    raise SystemExit(main())
