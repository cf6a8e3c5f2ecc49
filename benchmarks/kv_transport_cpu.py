"""The P2P KV connector's data path (shoal/kv_transfer), timed piece by piece on this host, for
one prompt of the Llama-3.1-8B shape (32 layers x 8 KV heads x 128 x K and V, bf16: 4096
tokens are 512 MiB):

1. readout: the producer reads the prompt's rows out of a paged cache (blocks of 16, in a
   shuffled order) into one host buffer (rows.gather_rows);
2. fetch: a consumer fetches the kept payload from the producer's KVServer over loopback TCP
   (P2PConnector's serve path, transport.fetch into a fresh host buffer): seconds and GB/s
   of each of --repeats fetches, then --parallel fetches at once (their aggregate GB/s);
   each first once cold (fresh host buffers), then warm (recycled, as in a running engine);
3. write-in: the rows go into the consumer's paged cache (blocks of 32, shuffled) with
   rows.scatter_rows, and are checked against the producer's.

    python benchmarks/kv_transport_cpu.py                      # -> benchmarks/results/
    python benchmarks/kv_transport_cpu.py --tokens 512 --out /tmp/kv.json   # quicker

On a CUDA machine (--device cuda) the caches are on the GPU and the host buffers pinned."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from results_file import REPO, default_path, record, write

sys.path.insert(0, str(REPO))

from shoal.kv_transfer.base import EngineInfo  # noqa: E402
from shoal.kv_transfer.config import KVTransferConfig  # noqa: E402
from shoal.kv_transfer.p2p import P2PConnector  # noqa: E402
from shoal.kv_transfer.payload import host_buffer  # noqa: E402
from shoal.kv_transfer.rows import gather_rows, scatter_rows  # noqa: E402
from shoal.kv_transfer.transport import fetch  # noqa: E402


def paged_caches(args: argparse.Namespace, block_size: int, seed: int
                 ) -> tuple[list[torch.Tensor], list[int]]:
    """Per layer a [2, slots, H, D] cache with room for the prompt plus as many free blocks,
    and the prompt's block ids in a shuffled order."""
    nblocks = 2 * -(-args.tokens // block_size)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(seed)
    caches = [torch.randn(2, nblocks * block_size, args.kv_heads, args.head_dim,
                          generator=gen).to(dtype).to(args.device) for _ in range(args.layers)]
    ids = torch.randperm(nblocks, generator=gen)[:nblocks // 2].tolist()
    return caches, ids


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def at_once(calls: list[Callable[[], None]]) -> tuple[float, list[float]]:
    """The calls run at once, a thread each: wall seconds and each call's seconds; the first
    error any raised is raised again here."""
    secs: list[float] = [0.0] * len(calls)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        t0 = time.perf_counter()
        try:
            calls[i]()
        except BaseException as e:  # reported below
            errors.append(e)
        secs[i] = time.perf_counter() - t0

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0, secs


def timed_fetches(port: int, keys: list[str], pinned: bool) -> tuple[float, list[float]]:
    """All keys fetched at once, one thread each: wall seconds and each fetch's seconds."""

    def fetch_one(key: str) -> Callable[[], None]:
        def call() -> None:
            header, data = fetch("127.0.0.1", port, {"key": key}, 120.0,
                                 alloc=lambda n: host_buffer(n, pinned))
            if data is None:
                raise RuntimeError(f"fetch of {key}: {header}")
        return call

    return at_once([fetch_one(k) for k in keys])


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Each measurement runs once cold (its host buffers fresh from the OS: slow to fault in
    on a busy VM) and then --repeats times warm (buffers recycled, as an engine's are)."""
    pinned = args.device.startswith("cuda")
    src, src_ids = paged_caches(args, 16, seed=0)
    synchronize(args.device)
    readout = []
    for _ in range(args.repeats + 1):
        t0 = time.perf_counter()
        payload = gather_rows(src, src_ids, 16, args.tokens)
        payload.wait()
        readout.append(time.perf_counter() - t0)
    nbytes = payload.nbytes

    producer = P2PConnector(KVTransferConfig("P2PConnector", "kv_producer", kv_port=0, extra={
        "kv_buffer_bytes": nbytes * (args.repeats + 2 * args.parallel + 2)}),
        EngineInfo(16, 1, "bench"))
    assert producer.server is not None
    try:
        single = []
        for i in range(args.repeats + 1):
            producer.saved({f"one-{i}": payload})
            _, (s,) = timed_fetches(producer.server.port, [f"one-{i}"], pinned)
            single.append(s)
        walls, each = [], []
        for r in range(2):  # cold, then warm
            keys = [f"par-{r}-{i}" for i in range(args.parallel)]
            producer.saved({k: payload for k in keys})
            wall, secs = timed_fetches(producer.server.port, keys, pinned)
            walls.append(wall)
            each.append(secs)
    finally:
        producer.shutdown()

    dst, dst_ids = paged_caches(args, 32, seed=1)
    writein = []
    for _ in range(args.repeats):
        synchronize(args.device)
        t0 = time.perf_counter()
        scatter_rows(dst, payload.layout, payload.data, dst_ids, 32, 0, args.tokens)
        synchronize(args.device)
        writein.append(time.perf_counter() - t0)
    check_rows(src, src_ids, dst, dst_ids, args.tokens)

    gbs = [nbytes / s / 1e9 for s in single]
    return {"payload_bytes": nbytes, "payload_mib": nbytes / 2**20,
            "readout_s": readout, "cold_readout_s": readout[0],
            "median_readout_s": float(np.median(readout[1:])),
            "fetch_s": single, "fetch_gb_per_s": gbs, "cold_fetch_gb_per_s": gbs[0],
            "median_fetch_gb_per_s": float(np.median(gbs[1:])),
            "parallel_fetches": args.parallel, "parallel_wall_s": walls,
            "parallel_each_s": each,
            "cold_parallel_aggregate_gb_per_s": nbytes * args.parallel / walls[0] / 1e9,
            "parallel_aggregate_gb_per_s": nbytes * args.parallel / walls[1] / 1e9,
            "writein_s": writein, "median_writein_s": float(np.median(writein)),
            "rows_checked": True}


def check_rows(src: list[torch.Tensor], src_ids: list[int], dst: list[torch.Tensor],
               dst_ids: list[int], n: int) -> None:
    """The written rows equal the read ones (first and last layer)."""
    def rows(caches: list[torch.Tensor], ids: list[int], bs: int, i: int) -> torch.Tensor:
        pos = torch.arange(n)
        slots = torch.tensor(ids)[pos // bs] * bs + pos % bs
        return caches[i][:, slots.to(caches[i].device)].cpu()

    for i in (0, len(src) - 1):
        if not torch.equal(rows(src, src_ids, 16, i), rows(dst, dst_ids, 32, i)):
            raise AssertionError(f"layer {i}: the written KV differs from the read KV")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--parallel", type=int, default=4,
                   help="fetches at once in the concurrent measurement")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    for name in ("layers", "kv_heads", "head_dim", "tokens", "repeats", "parallel"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main() -> int:
    args = parse()
    if args.threads:
        torch.set_num_threads(args.threads)
    figures = run(args)
    rec = record("kv-transport", "shoal", device=args.device, layers=args.layers,
                 kv_heads=args.kv_heads, head_dim=args.head_dim, tokens=args.tokens,
                 dtype=args.dtype, torch_threads=torch.get_num_threads(), **figures)
    out = args.out or default_path("kv-transport", suffix="" if args.device == "cpu"
                                   else f"-{args.device}")
    write(rec, out)
    print({k: v for k, v in figures.items() if k.startswith(("median", "parallel_agg", "cold"))})
    return 0


if __name__ == "__main__":
    sys.exit(main())
