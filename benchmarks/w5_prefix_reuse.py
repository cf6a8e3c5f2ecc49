"""W5, shared-prefix reuse: TTFT with the common prefix in device blocks, in the CPU tier, on
disk (cold and warm page cache), and recomputed, in one run of one engine.

    .venv/bin/python benchmarks/w5_prefix_reuse.py                  # CPU: SmolLM2-135M, 1024
    python benchmarks/w5_prefix_reuse.py --gpu                      # Llama-3.1-8B shape, 4096
    .venv/bin/python benchmarks/w5_prefix_reuse.py --smoke          # a quick check

Each condition first runs the prefix once (it is then in device blocks), then moves it:
  device     left where it is
  cpu        device prefix cache pushed into the CPU tier (shoal.kv_offload.control)
  disk       ... and the CPU tier flushed to disk, its files dropped from the page cache
  disk_warm  the same, files left in the page cache (what the disk tier costs without the drive)
  recompute  device prefix cache reset and every tier cleared
and measures (a) `--single-trials` lone requests (prefix + 64 fresh tokens, 1 output token),
re-placing the prefix before each, and (b) one batch of `--num-requests` requests (prefix + 64
unique tokens, `--output-len` outputs) submitted together. TTFT is first token time minus
arrival time, per request. Unique suffixes are fresh in every measurement, so only the
prefix can be reused. Disk measurements also give the effective read bandwidth: bytes the
disk tier loaded / its load seconds (wall time with at least one background read running,
checksums included), so cold vs warm shows what the drive, not the engine, limits.
Results: benchmarks/results/<date>-W5-<hardware>.json (smoke runs go to bench-work/results/)."""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import engine_internals
import numpy as np
import torch
from bench_args import add_common
from results_file import commit, cpu_model, default_path, record, write

from shoal import LLM, SamplingParams
from shoal.kv_cache.hashing import hash_full_blocks
from shoal.kv_offload.control import offload_device_prefix_cache

ROOT = Path(__file__).resolve().parent.parent
CONDITIONS = ("device", "cpu", "disk", "disk_warm", "recompute")
DISK_CONDITIONS = ("disk", "disk_warm")
TOKEN_RANGE = (100, 10000)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common(p, out=None, model=None, load_format=None, dtype="auto", seed=0, threads=None,
               num_requests=64, smoke="4 requests, 256-token prefix, 4 outputs")
    p.add_argument("--gpu", action="store_true", help="Llama-3.1-8B shape, dummy weights, bf16")
    p.add_argument("--prefix-len", type=int, default=None, help="1024 on CPU, 4096 with --gpu")
    p.add_argument("--unique-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--single-trials", type=int, default=3)
    p.add_argument("--kv-offloading-size", type=float, default=None, help="GiB (1 CPU, 8 GPU)")
    p.add_argument("--kv-offloading-disk-size", type=float, default=None, help="GiB (4, 32)")
    p.add_argument("--disk-path", default=None,
                   help="disk tier folder (default: a fresh one under bench-work/, removed after)")
    p.add_argument("--policy", default="lru")
    p.add_argument("--warm-page-cache", action="store_true",
                   help="ignored: cold (disk) and warm (disk_warm) page cache are both measured")
    args = p.parse_args()
    if args.gpu:
        args.model = args.model or "meta-llama/Llama-3.1-8B"
        args.load_format = args.load_format or "dummy"
    if args.smoke:
        args.prefix_len = args.prefix_len or 256
        args.num_requests, args.output_len, args.single_trials = 4, 4, 1
    args.prefix_len = args.prefix_len or (4096 if args.gpu else 1024)
    args.kv_offloading_size = args.kv_offloading_size or (8.0 if args.gpu else 1.0)
    args.kv_offloading_disk_size = args.kv_offloading_disk_size or (32.0 if args.gpu else 4.0)
    return args


def drop_page_cache(folder: Path) -> bool:
    """Asks the kernel to forget the tier's files, so "disk" reads the device, not memory
    (fsync first: dirty pages cannot be dropped). No root needed for files we own. False
    where the platform cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in folder.glob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return True


def read_gbps(nbytes: int, seconds: float) -> float | None:
    """Decimal GB/s; None when nothing was read."""
    return nbytes / seconds / 1e9 if nbytes and seconds > 0 else None


class Bench:
    def __init__(self, args: argparse.Namespace, disk_path: Path):
        self.args = args
        self.rng = np.random.default_rng(args.seed)
        self.prefix = self._tokens(args.prefix_len)
        max_len = args.prefix_len + args.unique_len + args.output_len + 16
        t0 = time.perf_counter()
        self.llm = LLM(model=args.model, load_format=args.load_format or "auto", dtype=args.dtype,
                       max_model_len=max_len, seed=args.seed,
                       kv_offloading_size=args.kv_offloading_size,
                       kv_offloading_disk_path=str(disk_path),
                       kv_offloading_disk_size=args.kv_offloading_disk_size,
                       kv_offloading_policy=args.policy)
        self.ready_s = time.perf_counter() - t0
        self.core = engine_internals.core(self.llm, required=True)
        self.store = self.core.kv_offload
        self.block_size = self.core.config.cache_config.block_size
        self.prefix_hashes = hash_full_blocks(self.prefix, self.block_size, [])
        self.page_cache_dropped: bool | None = None  # set by the first cold placement

    def _tokens(self, n: int) -> list[int]:
        return self.rng.integers(*TOKEN_RANGE, size=n).tolist()

    def _prompt(self) -> dict[str, list[int]]:
        return {"prompt_token_ids": self.prefix + self._tokens(self.args.unique_len)}

    def place_prefix(self, where: str) -> None:
        self.llm.generate(self._prompt(), SamplingParams(temperature=0, max_tokens=1),
                          use_tqdm=False)  # now in device blocks
        if where in ("cpu", *DISK_CONDITIONS):
            offload_device_prefix_cache(self.core)
        if where in DISK_CONDITIONS:
            self.store.flush()  # waits for the writes: the files are complete (and cached)
            if where == "disk":
                self.page_cache_dropped = drop_page_cache(self.store.tier("disk").dir)
        if where == "recompute":
            assert self.core.scheduler.kv.reset_prefix_cache()
            self.store.clear()
        # The fastest place holding the prefix's first block must be the one asked for.
        first = self.prefix_hashes[0]
        places = [("device", self.core.scheduler.kv.pool.get_cached_block(first) is not None),
                  ("cpu", self.store.cpu.contains(first)),
                  ("disk", any(t.name == "disk" and t.contains(first) for t in self.store.tiers))]
        fastest = next((name for name, held in places if held), "recompute")
        if fastest != where.removesuffix("_warm"):
            raise RuntimeError(f"prefix should be in {where}, found in {fastest}")

    def _tier_figures(self) -> dict[str, tuple[int, int, int, float]]:
        return {t.name: (t.hits, t.blocks_loaded, t.bytes_loaded, t.load_seconds)
                for t in self.store.stats().tiers}

    def measure(self, n: int, max_tokens: int) -> dict[str, Any]:
        before = self._tier_figures()
        sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = self.llm.generate([self._prompt() for _ in range(n)], sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
        after = self._tier_figures()
        disk_bytes = after["disk"][2] - before["disk"][2]
        disk_seconds = after["disk"][3] - before["disk"][3]
        return {
            "ttft_ms_mean": 1e3 * statistics.fmean(ttft),
            "ttft_ms_median": 1e3 * statistics.median(ttft),
            "ttft_ms_p99": 1e3 * ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "ttft_ms_min": 1e3 * ttft[0],
            "wall_s": wall,
            "num_cached_tokens_mean": statistics.fmean(o.num_cached_tokens for o in outs),
            "tier_blocks_loaded": {k: after[k][1] - before[k][1] for k in after},
            "disk_bytes_read": disk_bytes,
            "disk_read_seconds": disk_seconds,
            "disk_read_gbps": read_gbps(disk_bytes, disk_seconds),
        }

    def run(self) -> dict[str, Any]:
        a = self.args
        # Warm-up at the measured shapes (first large prefills and batches pay one-time costs),
        # on prompts that share nothing with the prefix.
        shape = a.prefix_len + a.unique_len
        warm = [{"prompt_token_ids": self._tokens(shape)} for _ in range(min(4, a.num_requests))]
        sp = SamplingParams(max_tokens=4, ignore_eos=True)
        self.llm.generate(warm[0], sp, use_tqdm=False)
        self.llm.generate(warm, sp, use_tqdm=False)
        results: dict[str, Any] = {}
        for where in CONDITIONS:
            singles = []
            for _ in range(a.single_trials):
                self.place_prefix(where)
                singles.append(self.measure(1, 1))
            self.place_prefix(where)
            batch = self.measure(a.num_requests, a.output_len)
            results[where] = {
                "single_ttft_ms_median": statistics.median(s["ttft_ms_mean"] for s in singles),
                "single_ttft_ms": [s["ttft_ms_mean"] for s in singles],
                "single_cached_tokens": singles[-1]["num_cached_tokens_mean"],
                "single_tier_blocks_loaded": singles[-1]["tier_blocks_loaded"],
                "batch": batch,
            }
            line = (f"[w5] {where:9s} single TTFT {results[where]['single_ttft_ms_median']:9.1f} ms"
                    f" (cached {results[where]['single_cached_tokens']:.0f})  batch TTFT mean "
                    f"{batch['ttft_ms_mean']:9.1f} ms p99 {batch['ttft_ms_p99']:9.1f} ms")
            if where in DISK_CONDITIONS:
                results[where]["single_disk_read_gbps"] = [s["disk_read_gbps"] for s in singles]
                line += f"  disk read {_gbps_text(singles + [batch])}"
            print(line, flush=True)
        results["disk_read"] = self.disk_read_summary(results)
        return results

    def disk_read_summary(self, results: dict[str, Any]) -> dict[str, Any]:
        """Effective disk-tier read bandwidth with a cold and a warm page cache, so the report
        can tell what the drive limits from what the engine does."""
        out: dict[str, Any] = {"page_cache_dropped": self.page_cache_dropped}
        for where, label in (("disk", "cold"), ("disk_warm", "warm")):
            batch = results[where]["batch"]
            out[label] = {
                "batch_bytes_read": batch["disk_bytes_read"],
                "batch_read_seconds": batch["disk_read_seconds"],
                "batch_read_gbps": batch["disk_read_gbps"],
                "single_read_gbps_median": _median(results[where]["single_disk_read_gbps"]),
            }
        return out


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _gbps_text(measurements: list[dict[str, Any]]) -> str:
    nbytes = sum(m["disk_bytes_read"] for m in measurements)
    gbps = read_gbps(nbytes, sum(m["disk_read_seconds"] for m in measurements))
    return f"{nbytes / 2**20:.0f} MiB at {gbps:.2f} GB/s" if gbps else "nothing read"


def main() -> int:
    args = parse_args()
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    work = ROOT / "bench-work"
    work.mkdir(exist_ok=True)
    own_disk = args.disk_path is None
    disk_path = Path(tempfile.mkdtemp(prefix="w5-disk-", dir=work)) if own_disk else Path(args.disk_path)
    try:
        bench = Bench(args, disk_path)
        results = bench.run()
        stats = {t.name: vars(t) for t in bench.store.stats().tiers}
    finally:
        if own_disk:
            shutil.rmtree(disk_path, ignore_errors=True)
    workload = {"id": "W5", "model": args.model or "SmolLM2-135M-Instruct (embedded)",
                "load_format": args.load_format or "auto", "dtype": args.dtype,
                "num_requests": args.num_requests, "prefix_len": args.prefix_len,
                "unique_len": args.unique_len, "output_len": args.output_len,
                "single_trials": args.single_trials, "seed": args.seed, "smoke": args.smoke,
                "kv_offloading_size_gib": args.kv_offloading_size,
                "kv_offloading_disk_size_gib": args.kv_offloading_disk_size,
                "kv_offloading_policy": args.policy, "block_size": bench.block_size,
                "disk_page_cache_dropped": bench.page_cache_dropped,
                "disk_read_threads": bench.store.tier("disk").reader.num_threads}
    rec = record("W5", "shoal", workload_params=workload, cpu_model=cpu_model(),
                 torch_threads=torch.get_num_threads(), ready_s=bench.ready_s,
                 figures=results, tier_stats=stats)
    write([rec], args.out or default_path("W5", smoke=args.smoke,
                                          suffix="-smoke" if args.smoke else ""))
    print(f"[w5] commit {commit()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
