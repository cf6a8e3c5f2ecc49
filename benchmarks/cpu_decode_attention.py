"""One layer's decode attention on the CPU at SmolLM2-135M's shapes (9 query heads, 3 KV
heads, head dim 64, block 16): the SDPA reference (gather every context out of the paged
cache, then one masked SDPA) against the C++ kernel (ops/cpu_paged_decode.py), both through
paged_attention (so each includes the write of the step's B new keys and values).

    .venv/bin/python benchmarks/cpu_decode_attention.py --out bench-work/cpu-decode-attn.json

Cases: batch 64 x 600 tokens of context (W6's batch) and batch 1 x 192, in bfloat16 and
float32, each sequence's blocks scattered at random over the cache. The two paths alternate
in rounds (--rounds of --reps calls each) so that a neighbour's load hits both alike; each
figure is the median over all its calls. Calls rotate over --layers caches, as a real step's
layers do, so that the KV comes from memory and not from the last-level cache. Records torch's thread count, /proc/loadavg and the
cores other processes took during each case (cpu_quiet.MachineLoad): other engineers share
the 2 cores of this machine."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))  # shoal, after any PYTHONPATH
from bench_args import add_common  # noqa: E402
from cpu_quiet import MachineLoad, wait_quiet  # noqa: E402
from results_file import cpu_model, provenance, write  # noqa: E402

from shoal.attention.metadata import build_attention_metadata  # noqa: E402
from shoal.attention.ops import cpu_paged_decode  # noqa: E402
from shoal.attention.torch_backend import paged_attention  # noqa: E402

HQ, HK, D, BLOCK = 9, 3, 64, 16
CASES = ((64, 600), (1, 192))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common(p, out="bench-work/cpu_decode_attention.json", rounds=10, threads=None)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--reps", type=int, default=0,
                   help="calls per path per round (default: 10 at batch 64, 100 at batch 1)")
    p.add_argument("--layers", type=int, default=8,
                   help="caches the calls rotate over, so each call finds its KV cold as in a "
                        "real step (8 x 15-30 MB at batch 64 is well past a 32 MB L3)")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="S",
                   help="before each case, wait up to S seconds for other processes to use "
                        "under 0.1 cores (0: do not wait)")
    return p.parse_args(argv)


def make_step(batch: int, context: int, dtype: torch.dtype, layers: int) -> tuple:
    """q, k, v, `layers` caches and the metadata of one decode step: each sequence at
    `context` cached tokens plus the new one."""
    gen = torch.Generator().manual_seed(0)
    per_seq = -(-(context + 1) // BLOCK)
    num_blocks = batch * per_seq + 1
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [perm[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
    caches = [torch.randn(2, num_blocks * BLOCK, HK, D, generator=gen).to(dtype)
              for _ in range(layers)]
    md = build_attention_metadata(
        query_lens=[1] * batch, context_lens=[context] * batch, block_tables=tables,
        block_size=BLOCK, num_decodes=batch, sliding_window=None, device=torch.device("cpu"),
        null_block=perm[-1])
    q, k, v = (torch.randn(batch, h, D, generator=gen).to(dtype) for h in (HQ, HK, HK))
    return q, k, v, caches, md


def time_case(batch: int, context: int, dtype: torch.dtype, rounds: int, reps: int,
              layers: int) -> dict[str, Any]:
    q, k, v, caches, md = make_step(batch, context, dtype, layers)
    scale = 1.0 / math.sqrt(D)
    paths = {"sdpa_ms": False, "kernel_ms": True}
    outs = {name: paged_attention(q, k, v, caches[0], md, scale, decode_kernel=flag)
            for name, flag in paths.items()}  # also the warm-up
    samples: dict[str, list[float]] = {name: [] for name in paths}
    load = MachineLoad()
    loadavg_before = Path("/proc/loadavg").read_text().split()[:3]
    for _ in range(rounds):
        for name, flag in paths.items():
            for i in range(reps):
                cache = caches[i % layers]
                t0 = time.perf_counter()
                paged_attention(q, k, v, cache, md, scale, decode_kernel=flag)
                samples[name].append((time.perf_counter() - t0) * 1e3)
    res: dict[str, Any] = {"batch": batch, "context": context, "dtype": str(dtype)[6:],
                           "calls_per_path": rounds * reps, "caches_rotated": layers}
    for name, xs in samples.items():
        res[name] = round(statistics.median(xs), 4)
        res[name.replace("_ms", "_min_ms")] = round(min(xs), 4)
    res["speedup"] = round(res["sdpa_ms"] / res["kernel_ms"], 2)
    kv_bytes = 2 * batch * (context + 1) * HK * D * caches[0].element_size()
    res["kernel_kv_read_gb_s"] = round(kv_bytes / res["kernel_ms"] / 1e6, 2)
    res["max_abs_diff"] = (outs["sdpa_ms"].float() - outs["kernel_ms"].float()).abs().max().item()
    res["load"] = {**load.result(), "loadavg_before": loadavg_before,
                   "loadavg_after": Path("/proc/loadavg").read_text().split()[:3]}
    return res


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not cpu_paged_decode.available():
        print(f"the kernel is not available: {cpu_paged_decode.unavailable_reason()}")
        return 1
    records = []
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for batch, context in CASES:
            reps = args.reps or (10 if batch > 8 else 100)
            waited = wait_quiet(limit=args.wait_quiet) if args.wait_quiet else 0.0
            rec = {**time_case(batch, context, dtype, args.rounds, reps, args.layers),
                   "waited_for_quiet_s": round(waited, 1)}
            print(json.dumps(rec), flush=True)
            records.append(rec)
    result = {**provenance(),
              "benchmark": "CPU decode attention, one layer, SmolLM2-135M shapes "
                           f"(Hq {HQ}, Hk {HK}, D {D}, block {BLOCK})",
              "cpu": cpu_model(), "torch": torch.__version__,
              "torch_threads": torch.get_num_threads(), "records": records}
    write(result, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
