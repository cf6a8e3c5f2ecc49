"""MLA decode attention on a GPU (written for one H200): the weight-absorbed form over a paged
latent cache (shoal's mla_paged_decode) against the expanded form, one query token per
sequence, at context lengths 1k, 8k and 32k and batch 1 and 8, for DeepSeek-V2-Lite (H = 16)
and DeepSeek-V3 (H = 128) head counts.

    python benchmarks/mla_decode_gpu.py --out benchmarks/results/mla-decode-H200.json
    TRITON_INTERPRET=1 python benchmarks/mla_decode_gpu.py --smoke --out /tmp/mla.json  # CPU

Shapes (DeepSeek-V2/V3 attention): kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim
128, v_head_dim 128; kv_b_proj W [H * (128 + 128), 512]; random bf16 data and weights; the
latent cache is [num_slots, 576] with each sequence's blocks scattered over it (block 16).

(a) absorbed: q_nope [B, H, 128] @ W_UK -> [B, H, 512], concatenated with q_pe into the
    [B, H, 576] query; mla_paged_decode over the latent cache; its [B, H, 512] output @ W_UV
    -> [B, H * 128]. Also the kernel alone (kernel_ms), for the bandwidth figure: latent bytes
    of the context (B * ctx * 576 * 2) / kernel time, against the H200's ~4.8 TB/s.
(b) expanded: the context's latents gathered through the block tables, up-projected with
    kv_b_proj to per-head K (nope 128 + the shared rope 64) and V (128), then torch's
    scaled_dot_product_attention for the one query. Only where its intermediates fit in free
    memory (est_expanded_gib).

Each figure is the median of --repeats calls, timed with CUDA events around one replay of a
CUDA graph of the call (--eager: the plain call, launch gaps included), L2 flushed before each
call (a 32k-token latent context is ~38 MB, inside the H200's 60 MB L2). KV bytes per token of
each form's cache: 576 * 2 latent vs H * (192 + 128) * 2 for expanded K/V caches. Both forms'
outputs are compared (max_abs_err). Writes one JSON list of records (results_file.py) to --out."""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parent.parent))  # shoal, after any PYTHONPATH
from bench_args import add_common  # noqa: E402
from results_file import record, write  # noqa: E402

from shoal.attention.ops.mla_decode import mla_paged_decode  # noqa: E402

H200_TBPS = 4.8
FULL = dict(kv_lora=512, rope=64, nope=128, v_head=128, heads=(16, 128),
            contexts=(1024, 8192, 32768), batches=(1, 8), block_size=16, dtype=torch.bfloat16)
SMOKE = dict(kv_lora=32, rope=16, nope=16, v_head=16, heads=(4,), contexts=(40,),
             batches=(1, 2), block_size=16, dtype=torch.float32)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common(p, out="bench-work/mla_decode_gpu.json", repeats=20,
               smoke="tiny dims (latent 32 + rope 16, H 4, 40 tokens, fp32), 1 repeat; runs on "
                     "the CPU under TRITON_INTERPRET=1")
    p.add_argument("--heads", default=None, help="comma list of query heads (16,128)")
    p.add_argument("--contexts", default=None, help="comma list of context lengths")
    p.add_argument("--batches", default=None, help="comma list of batch sizes (1,8)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--num-splits", type=int, default=None,
                   help="fixed split-K count (default: the kernel's heuristic)")
    p.add_argument("--eager", action="store_true", help="time plain calls, not CUDA graphs")
    p.add_argument("--no-expanded", action="store_true", help="skip the expanded form")
    return p.parse_args(argv)


def _ints(text: str | None, default: tuple[int, ...]) -> list[int]:
    return [int(x) for x in text.split(",")] if text else list(default)


class Timer:
    """Median milliseconds of fn over repeats: CUDA events around a graph replay (or the
    eager call) with L2 flushed before each; perf_counter on the CPU."""

    def __init__(self, device: torch.device, repeats: int, warmup: int, graphs: bool) -> None:
        self.device, self.repeats, self.warmup, self.graphs = device, repeats, warmup, graphs
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=device) \
            if device.type == "cuda" else None

    def __call__(self, fn: Callable[[], Any]) -> tuple[float, str]:
        for _ in range(self.warmup):
            fn()
        if self.device.type != "cuda":
            times = []
            for _ in range(self.repeats):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return statistics.median(times), "cpu_wall"
        call, how = fn, "eager"
        if self.graphs:
            try:
                call, how = _graph(fn), "cuda_graph"
            except RuntimeError as e:  # capture refused: time the eager call
                print(f"  graph capture failed ({e}); timing eager", flush=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(self.repeats):
            self.flush.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times), how


def _graph(fn: Callable[[], Any]) -> Callable[[], Any]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm on the side stream, as capture needs
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def run_case(cfg: dict[str, Any], h: int, b: int, ctx: int, timer: Timer, device: torch.device,
             num_splits: int | None, expanded: bool) -> dict[str, Any]:
    lat, rope, nope, vh, bs, dt = (cfg[k] for k in ("kv_lora", "rope", "nope", "v_head",
                                                     "block_size", "dtype"))
    dk = lat + rope
    esize = torch.empty(0, dtype=dt).element_size()
    gen = torch.Generator(device="cpu").manual_seed(h * 7919 + b * 31 + ctx)
    blocks_per_seq = -(-ctx // bs)
    num_blocks = b * blocks_per_seq + 1
    perm = torch.randperm(num_blocks, generator=gen)[:b * blocks_per_seq]
    tables = perm.view(b, blocks_per_seq).to(torch.int32).to(device)
    seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
    cache = (torch.randn(num_blocks * bs, dk, generator=gen) * 0.5).to(device, dt)
    w_kv_b = (torch.randn(h * (nope + vh), lat, generator=gen) / math.sqrt(lat)).to(device, dt)
    w3 = w_kv_b.view(h, nope + vh, lat)
    w_uk = w3[:, :nope].contiguous()  # [H, nope, L]
    w_uv_t = w3[:, nope:].transpose(1, 2).contiguous()  # [H, L, V]
    q_nope = torch.randn(b, h, nope, generator=gen).to(device, dt)
    q_pe = torch.randn(b, h, rope, generator=gen).to(device, dt)
    scale = 1.0 / math.sqrt(nope + rope)
    q_lat = torch.empty(b, h, dk, dtype=dt, device=device)
    o_lat = torch.empty(b, h, lat, dtype=dt, device=device)

    def absorbed() -> torch.Tensor:
        q_lat[:, :, :lat] = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        q_lat[:, :, lat:] = q_pe
        mla_paged_decode(q_lat, cache, tables, seq_lens, bs, scale, lat,
                         num_splits=num_splits, out=o_lat)
        return torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1).reshape(b, h * vh)

    def kernel() -> torch.Tensor:
        return mla_paged_decode(q_lat, cache, tables, seq_lens, bs, scale, lat,
                                num_splits=num_splits, out=o_lat)

    pos = torch.arange(ctx, device=device)
    slots = (tables.long()[:, pos // bs] * bs + pos % bs).reshape(-1)  # metadata, untimed
    q_full = torch.cat([q_nope, q_pe], -1).unsqueeze(2)  # [B, H, 1, nope + rope]

    def expanded_form() -> torch.Tensor:
        c = cache.index_select(0, slots).view(b, ctx, dk)
        kv = torch.matmul(c[..., :lat], w_kv_b.t()).view(b, ctx, h, nope + vh)
        k = torch.cat([kv[..., :nope], c[:, :, None, lat:].expand(b, ctx, h, rope)], -1)
        v = kv[..., nope:]
        o = torch.nn.functional.scaled_dot_product_attention(
            q_full, k.transpose(1, 2), v.transpose(1, 2), scale=scale)
        return o.reshape(b, h * vh)

    row: dict[str, Any] = dict(
        heads=h, batch=b, context=ctx, kv_lora_rank=lat, qk_rope_head_dim=rope,
        qk_nope_head_dim=nope, v_head_dim=vh, block_size=bs, dtype=str(dt).split(".")[-1],
        num_splits=num_splits, kv_bytes_per_token_latent=dk * esize,
        kv_bytes_per_token_expanded=h * (nope + rope + vh) * esize)
    row["kv_bytes_ratio"] = row["kv_bytes_per_token_expanded"] / row["kv_bytes_per_token_latent"]
    row["absorbed_ms"], row["timing"] = timer(absorbed)
    row["kernel_ms"], _ = timer(kernel)
    latent_bytes = b * ctx * dk * esize
    row["latent_bytes_read"] = latent_bytes
    row["kernel_tbps"] = latent_bytes / (row["kernel_ms"] * 1e-3) / 1e12
    row["kernel_fraction_of_h200_bw"] = row["kernel_tbps"] / H200_TBPS

    # Intermediates of the expanded form: gathered latents, kv, k (with rope), v/out copies.
    est = b * ctx * (dk + h * (nope + vh) + h * (nope + rope) + h * vh) * esize * 1.3
    row["est_expanded_gib"] = est / 2**30
    row["expanded_ms"] = row["speedup_absorbed_vs_expanded"] = row["max_abs_err"] = None
    fits = device.type != "cuda" or est < 0.8 * torch.cuda.mem_get_info(device)[0]
    if expanded and fits:
        try:
            ref = expanded_form().float()
            row["max_abs_err"] = (absorbed().float() - ref).abs().max().item()
            del ref
            row["expanded_ms"], _ = timer(expanded_form)
            row["speedup_absorbed_vs_expanded"] = row["expanded_ms"] / row["absorbed_ms"]
        except torch.OutOfMemoryError:
            row["expanded_skipped"] = "out of memory"
    elif expanded:
        row["expanded_skipped"] = f"needs ~{est / 2**30:.1f} GiB"
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    cfg = dict(SMOKE if args.smoke else FULL)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    repeats = 1 if args.smoke else args.repeats
    warmup = 0 if args.smoke else args.warmup
    timer = Timer(device, repeats, warmup, graphs=not args.eager)
    records = []
    for h in _ints(args.heads, cfg["heads"]):
        for ctx in _ints(args.contexts, cfg["contexts"]):
            for b in _ints(args.batches, cfg["batches"]):
                row = run_case(cfg, h, b, ctx, timer, device, args.num_splits,
                               not args.no_expanded)
                exp = row["expanded_ms"]
                print(f"H={h:3d} B={b} ctx={ctx:6d}: absorbed {row['absorbed_ms']:.3f} ms "
                      f"(kernel {row['kernel_ms']:.3f} ms, {row['kernel_tbps']:.2f} TB/s), "
                      + (f"expanded {exp:.3f} ms, x{row['speedup_absorbed_vs_expanded']:.1f}, "
                         f"err {row['max_abs_err']:.3g}" if exp is not None
                         else f"expanded skipped ({row.get('expanded_skipped', 'off')})"),
                      flush=True)
                records.append(record("mla_decode", "shoal", smoke=args.smoke, **row))
    write(records, args.out)
    return records


if __name__ == "__main__":
    main()
