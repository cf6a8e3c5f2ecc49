"""What holds the INT4 decode GEMV at one row near 2 TB/s: its read pattern, its layout, its
programs per multiprocessor, or the L2-warm timing its tuner uses. One GPU call.

At Llama-3.1-8B's four projections (codes int32 [K / 8, N], GPTQ's layout, g128, bf16), for
each tensor-core tile (int4_mma_gemv.TILES) and K splits giving 1, 2, 4 and 8 programs a
multiprocessor, it times in CUDA graphs (median of three replays of REPEATS calls):

- read: a kernel that only reads the codes tile by tile as the GEMV does (same grid, same
  [BLOCK_N, WORDS] steps, xor-summed so nothing is skipped), from GPTQ's layout and from
  tile_codes' (each step's tile one contiguous run);
- gemv: the GEMV itself (int4_mma_gemv) on either layout;
- each twice: `hot` (the same weights every call, as launch_tuner times them: what fits in
  L2 stays there) and `cold` (calls rotating over copies of at least 2.5x the L2 size, as a
  decode step meets each layer's weights once);
- flat: the whole codes tensor read in long contiguous runs (the ceiling of a read, cold).

TB/s counts the codes and scales (the read kernels: the codes). Reading the result: read
near flat while gemv is far below points at the kernel's latency between its loads; read far
below flat at the pattern or the layout (gptq vs tiled); hot far above cold at a tuner that
picks tiles for L2-resident weights. --smoke runs the kernels on tiny shapes on the CPU
(Triton's interpreter) and checks the read sums and GEMV outputs agree across layouts."""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

if "--smoke" in sys.argv:  # Triton reads it when a kernel is defined: before the imports
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_file import default_path, record, write  # noqa: E402

from shoal.layers.quantization import int4_mma_gemv as mma  # noqa: E402
from shoal.layers.quantization import launch_tuner  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
GROUP, WORDS, REPEATS = 128, 16, 20
PER_SM = (1, 2, 4, 8)


@triton.jit
def _read_tiles_kernel(w_ptr, out_ptr, N, K, K_SPLIT, stride_wk, BLOCK_N: tl.constexpr,
                       WORDS: tl.constexpr, TILED: tl.constexpr):
    """out[pid_k, n] = xor of the codes of column n over the program's K span: the GEMV's
    grid and word tiles, and nothing else."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_start = pid_k * K_SPLIT
    k_end = tl.minimum(k_start + K_SPLIT, K)
    if TILED:
        tile = (pid_n * (K // (8 * WORDS)) + k_start // (8 * WORDS)).to(tl.int64)
        ptrs = (w_ptr + tile * (WORDS * BLOCK_N) + tl.arange(0, WORDS)[None, :] * BLOCK_N
                + tl.arange(0, BLOCK_N)[:, None])
        step = WORDS * BLOCK_N
    else:
        ptrs = (w_ptr + (k_start // 8 + tl.arange(0, WORDS)).to(tl.int64)[None, :] * stride_wk
                + offs_n[:, None])
        step = WORDS * stride_wk
    acc = tl.zeros([BLOCK_N, WORDS], dtype=tl.int32)
    for _ in range(k_start, k_end, 8 * WORDS):
        acc ^= tl.load(ptrs)
        ptrs += step
    tl.store(out_ptr + pid_k * N + offs_n, tl.xor_sum(acc, axis=1))


@triton.jit
def _read_flat_kernel(w_ptr, out_ptr, total, PER_PROGRAM, BLOCK: tl.constexpr):
    """out[pid] = xor of the program's PER_PROGRAM words, read BLOCK at a time."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * PER_PROGRAM
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, PER_PROGRAM, BLOCK):
        offs = start + i + tl.arange(0, BLOCK)
        acc ^= tl.load(w_ptr + offs, mask=offs < total, other=0)
    tl.store(out_ptr + pid, tl.xor_sum(acc, axis=0))


def read_tiles(codes: torch.Tensor, n: int, k: int, block_n: int, split: int, warps: int,
               tiled: bool) -> torch.Tensor:
    """[split', N] xor sums (split' as k_split recomputes it)."""
    span = triton.cdiv(triton.cdiv(k, 8 * WORDS), split) * 8 * WORDS
    split = triton.cdiv(k, span)
    out = torch.empty((split, n), dtype=torch.int32, device=codes.device)
    _read_tiles_kernel[(n // block_n, split)](
        codes, out, n, k, span, 0 if tiled else codes.stride(0), BLOCK_N=block_n, WORDS=WORDS,
        TILED=tiled, num_warps=warps, num_stages=1)
    return out


def read_flat(codes: torch.Tensor, programs: int, block: int, warps: int) -> torch.Tensor:
    total = codes.numel()
    per = triton.cdiv(triton.cdiv(total, programs), block) * block
    out = torch.empty(triton.cdiv(total, per), dtype=torch.int32, device=codes.device)
    _read_flat_kernel[(out.numel(),)](codes, out, total, per, BLOCK=block, num_warps=warps)
    return out


def split_for(n: int, block_n: int, per_sm: int, sms: int, k: int) -> int:
    """The power-of-two K split nearest per_sm programs a multiprocessor (at most the steps)."""
    want = per_sm * sms / (n // block_n)
    return min(k // (8 * WORDS), 1 << max(0, round(math.log2(want))))


def time_us(calls: list[Callable[[], object]]) -> float:
    """Microseconds a call: REPEATS calls cycling over `calls` in one CUDA graph
    (launch_tuner.graph_us), the median of three replays."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    turn = itertools.cycle(calls)
    return launch_tuner.graph_us(lambda: next(turn)(), REPEATS)


def _problem(n: int, k: int, dev: torch.device, seed: int):
    g = torch.Generator(device="cpu").manual_seed(seed)
    codes = torch.randint(-(1 << 31), 1 << 31, (k // 8, n), generator=g,
                          dtype=torch.int64).to(torch.int32).to(dev)
    scales = ((torch.rand(k // GROUP, n, generator=g) + 0.5) / 16).to(torch.bfloat16).to(dev)
    x = torch.randn(1, k, generator=g).to(torch.bfloat16).to(dev)
    return x, codes, scales


def _run_once(calls: list[Callable[[], object]]) -> float:
    """--smoke's stand-in for time_us: the first call once (the interpreter), 1 us."""
    calls[0]()
    return 1.0


def probe_shape(name: str, n: int, k: int, dev: torch.device, sms: int, l2: int,
                timer: Callable[[list[Callable[[], object]]], float] = time_us,
                per_sms: tuple[int, ...] = PER_SM) -> dict:
    nbytes_codes = n * k // 2
    nbytes = nbytes_codes + n * (k // GROUP) * 2
    copies = max(2, math.ceil(2.5 * l2 / nbytes))
    problems = [_problem(n, k, dev, seed) for seed in range(copies)]
    x = problems[0][0]
    row: dict[str, Any] = {"n": n, "k": k, "codes_mb": nbytes_codes / 1e6, "copies": copies,
                           "tiles": []}
    flat = {}
    for programs in (sms * 2, sms * 4, sms * 8):
        for block, warps in ((1024, 4), (2048, 8), (4096, 8)):
            us = timer([partial(read_flat, c, programs, block, warps)
                          for _, c, _ in problems])
            flat[f"p{programs} b{block} w{warps}"] = round(nbytes_codes / us / 1e6, 3)
    row["flat_best_tb_s"] = max(flat.values())
    row["flat"] = flat
    for block_n, warps in mma.TILES:
        tiled = [mma.tile_codes(c, block_n, WORDS) for _, c, _ in problems]
        for per_sm in per_sms:
            split = split_for(n, block_n, per_sm, sms, k)
            cell: dict[str, Any] = {"block_n": block_n, "warps": warps, "split": split,
                                    "programs_per_sm": round(n // block_n * split / sms, 2)}
            for layout, sets in (("gptq", [c for _, c, _ in problems]), ("tiled", tiled)):
                is_tiled = layout == "tiled"
                reads = [partial(read_tiles, c, n, k, block_n, split, warps, is_tiled)
                         for c in sets]
                gemvs = [partial(mma.int4_mma_gemv, x, c, s, None, GROUP, block_n=block_n,
                                 words=WORDS, split=split, num_warps=warps, num_stages=1,
                                 tiled=is_tiled)
                         for c, (_, _, s) in zip(sets, problems)]
                for what, calls, size in (("read", reads, nbytes_codes),
                                          ("gemv", gemvs, nbytes)):
                    for temp, use in (("hot", calls[:1]), ("cold", calls)):
                        try:
                            us = timer(use)
                        except Exception as e:  # noqa: BLE001 (a tile this GPU cannot run)
                            cell[f"{what}_{layout}_{temp}_error"] = f"{type(e).__name__}: {e}"
                            continue
                        cell[f"{what}_{layout}_{temp}_us"] = round(us, 2)
                        cell[f"{what}_{layout}_{temp}_tb_s"] = round(size / us / 1e6, 3)
            row["tiles"].append(cell)
            print(name, cell, flush=True)
    for layout in ("gptq", "tiled"):
        for temp in ("hot", "cold"):
            key = f"gemv_{layout}_{temp}_us"
            best = min((c for c in row["tiles"] if key in c), key=lambda c: c[key], default=None)
            if best:
                row[f"best_gemv_{layout}_{temp}"] = {
                    "us": best[key], "tile": f"n{best['block_n']} w{best['warps']} "
                    f"split{best['split']}"}
    # the tile the hot timing picks, timed cold: what the tuner's choice costs a decode step
    hot = min((c for c in row["tiles"] if "gemv_gptq_hot_us" in c),
              key=lambda c: c["gemv_gptq_hot_us"], default=None)
    if hot and "gemv_gptq_cold_us" in hot:
        row["hot_pick_cold_us"] = hot["gemv_gptq_cold_us"]
    return row


def smoke() -> dict:
    """Tiny shapes in the interpreter: every read sum and GEMV output agrees across layouts and
    with torch."""
    n, k, block_n = 64, 512, 32
    x, codes, scales = _problem(n, k, torch.device("cpu"), 0)
    want = codes.view(-1, WORDS, n).numpy()
    checked = 0
    for split in (1, 2):
        steps = k // (8 * WORDS) // split
        ref = torch.from_numpy(_xor_reduce(want.reshape(split, steps * WORDS, n)))
        for tiled, c in ((False, codes), (True, mma.tile_codes(codes, block_n, WORDS))):
            got = read_tiles(c, n, k, block_n, split, 4, tiled)
            assert torch.equal(got, ref), (split, tiled)
            checked += 1
        plain = mma.int4_mma_gemv(x, codes, scales, None, GROUP, block_n=block_n, words=WORDS,
                                  split=split, num_warps=4, num_stages=1)
        tiled_out = mma.int4_mma_gemv(x, mma.tile_codes(codes, block_n, WORDS), scales, None,
                                      GROUP, block_n=block_n, words=WORDS, split=split,
                                      num_warps=4, num_stages=1, tiled=True)
        assert torch.equal(plain, tiled_out)
    flat = read_flat(codes, 3, 256, 4)
    assert int(_xor_reduce(flat.numpy()[None])[0]) == int(_xor_reduce(
        codes.reshape(1, -1).numpy())[0])
    # the GPU run's bookkeeping, a call of each kind made once (a 256-wide shape: each tile fits)
    row = probe_shape("smoke", 256, 256, torch.device("cpu"), sms=2, l2=1 << 16,
                      timer=_run_once, per_sms=(2,))
    assert len(row["tiles"]) == len(mma.TILES) and "hot_pick_cold_us" in row
    return {"checked_read_sums": checked, "gemv_layouts_agree": True, "flat_agrees": True,
            "cells": len(row["tiles"])}


def _xor_reduce(a):
    import numpy as np

    return np.bitwise_xor.reduce(a, axis=1)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES), help="of " + ",".join(SHAPES))
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (interpreter)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if args.smoke:
        rec = record("int4-read-probe", "shoal", smoke=smoke())
    else:
        dev = torch.device("cuda")
        props = torch.cuda.get_device_properties(dev)
        sms, l2 = props.multi_processor_count, props.L2_cache_size
        shapes = {s: probe_shape(s, *SHAPES[s], dev, sms, l2) for s in args.shapes.split(",")}
        rec = record("int4-read-probe", "shoal", gpu=props.name, sms=sms, l2_bytes=l2,
                     repeats=REPEATS, words=WORDS, group=GROUP, shapes=shapes)
    write(rec, args.out or default_path("int4-read-probe", smoke=args.smoke))
    return 0


if __name__ == "__main__":
    sys.exit(main())
