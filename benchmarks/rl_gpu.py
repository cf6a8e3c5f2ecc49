"""Engines inside training loops on one GPU (written for an H200): the Llama-3.1-8B shape
(load_format=dummy), GPU memory after sleep level 1 and 2 from the CUDA allocator's counters
(torch.cuda.memory_allocated / memory_reserved, and the device's used memory from
torch.cuda.mem_get_info), sleep and wake times, the time of a full weight update from a dict of
device tensors and its bandwidth, and N sleep / update / wake / generate cycles with the
allocator's figures after each (growth would show).

    python benchmarks/rl_gpu.py --out bench-work/rl-h200.json [--cycles 20]
    python benchmarks/rl_gpu.py --smoke --out /tmp/rl.json      # CPU, tiny model"""

from __future__ import annotations

import argparse
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=offline_runs.LLAMA_8B)
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    import torch

    from shoal import LLM, SamplingParams

    model = args.model if not args.smoke else offline_runs.tiny_llama(Path(tempfile.mkdtemp()))
    kw: dict[str, Any] = (dict(load_format="dummy", max_model_len=4096,
                               gpu_memory_utilization=0.6) if not args.smoke else
                          dict(load_format="dummy", device="cpu", max_model_len=512))
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
    write([record("rl_lifecycle", "shoal", model=args.model, dtype=str(runner.dtype),
                  weight_bytes=weight_bytes, **fig)], args.out)
    del torch
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
