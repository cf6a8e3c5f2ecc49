"""GB/s of one prompt's KV moving from a producer P2PConnector to a consumer's on this host,
through the real classes (a producer connector in a process of its own, as a prefill engine
is; the consumer's P2PConnector._fetch with its digest check and its host buffer), for the
Llama-3.1-8B shape (32 layers x 8 KV heads x 128 x K and V, bf16: 4096 tokens are 512 MiB).

Each --path (tcp: the bytes over loopback TCP; shm: the consumer copies them out of the
producer's /dev/shm file, kv_shared_memory) is timed
- with the producer's payload where a CPU engine's readout puts it (a recycled host buffer of
  /dev/shm: served in place) and, --foreign, in plain memory (as a CUDA engine's pinned one:
  the producer then sends it on the socket whatever the path; until 2026-12-06 the shm path
  staged it into a shared buffer, measured in benchmarks/results/2026-12-06-kv-transfer-cpu.json
  and dropped as no faster);
- idle, and --busy: a thread of the consumer's process spins in Python meanwhile, as a
  decode engine's loop of empty steps does while fetches run (it holds the interpreter
  lock, which each socket read takes back; on a host of few cores it also takes a core);
- one fetch at a time (--repeats, after one untimed), then --parallel at once.

    python benchmarks/kv_transfer_bench.py                    # -> benchmarks/results/
    python benchmarks/kv_transfer_bench.py --tokens 512 --repeats 2 --out /tmp/kv.json"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from kv_transport_cpu import at_once
from results_file import REPO, default_path, record, write

sys.path.insert(0, str(REPO))

from shoal.core.kv_connector_plan import KVLayout  # noqa: E402
from shoal.kv_transfer.base import EngineInfo  # noqa: E402
from shoal.kv_transfer.config import KVTransferConfig  # noqa: E402
from shoal.kv_transfer.p2p import P2PConnector, prompt_digest  # noqa: E402
from shoal.kv_transfer.payload import KVPayload, host_buffer  # noqa: E402

PATHS = ("tcp", "shm")


@contextlib.contextmanager
def busy_loop(on: bool) -> Iterator[None]:
    """A thread spinning in Python (an engine's loop of empty steps while fetches run)."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for i in range(200):
                x += i

    thread = threading.Thread(target=spin, daemon=True)
    if on:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if on:
            thread.join()


def make_payload(args: argparse.Namespace, foreign: bool) -> KVPayload:
    row = args.head_dim * 2  # bf16 bytes of one head's row
    layout = KVLayout("bfloat16", args.tokens, [[2, args.tokens, args.kv_heads, row]]
                      * args.layers)
    data = np.empty(layout.nbytes, dtype=np.uint8) if foreign else host_buffer(layout.nbytes)
    np.frombuffer(data, dtype=np.uint8)[:] = np.random.default_rng(0).integers(
        0, 256, layout.nbytes, dtype=np.uint8)
    return KVPayload(layout, data)


def producer_process(conn: Any, path: str, args: argparse.Namespace, foreign: bool,
                     prompt: list[int]) -> None:
    """The producer engine's process: a P2PConnector keeping one payload under each key it
    is asked for (sent back through `conn`)."""
    payload = make_payload(args, foreign)
    producer = P2PConnector(KVTransferConfig(
        "P2PConnector", "kv_producer", kv_port=0,
        extra={"kv_shared_memory": path == "shm",
               "kv_buffer_bytes": payload.nbytes * (args.parallel + 2)}),
        EngineInfo(16, 1, "bench"))
    assert producer.server is not None
    conn.send((producer.server.port, payload.nbytes))
    digest, serial = prompt_digest(prompt), 0
    while (n := conn.recv()) is not None:
        keys = []
        for _ in range(n):
            serial += 1
            keys.append(key := f"bench-{serial}")
            producer._pending_saves[key] = digest
            producer.saved({key: payload})
        conn.send(keys)
    producer.shutdown()


def fetch_all(consumer: P2PConnector, port: int, prompt: list[int], keys: list[str]
              ) -> tuple[float, list[float]]:
    """The keys fetched at once by the consumer connector, a thread each: wall seconds and
    each fetch's seconds."""

    def fetch_one(key: str) -> Callable[[], None]:
        def call() -> None:
            got = consumer._fetch({"remote_host": "127.0.0.1", "remote_port": port,
                                   "remote_request_id": key}, prompt)
            if got.payload is None:
                raise RuntimeError(f"the fetch of {key} failed (see the warnings above)")
        return call

    return at_once([fetch_one(k) for k in keys])


def measure(args: argparse.Namespace, path: str, foreign: bool, busy: bool) -> dict[str, Any]:
    prompt = list(range(args.tokens))
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(
        target=producer_process, args=(child, path, args, foreign, prompt), daemon=True)
    proc.start()
    port, nbytes = parent.recv()
    consumer = P2PConnector(KVTransferConfig(
        "P2PConnector", "kv_consumer", extra={"kv_shared_memory": path == "shm",
                                              "kv_fetch_workers": args.parallel}),
        EngineInfo(16, 1, "bench"))
    try:
        with busy_loop(busy):
            single = []
            for _ in range(args.repeats + 1):  # the first warms the buffers up: untimed
                parent.send(1)
                _, (s,) = fetch_all(consumer, port, prompt, parent.recv())
                single.append(s)
            parent.send(args.parallel)
            wall, each = fetch_all(consumer, port, prompt, parent.recv())
    finally:
        parent.send(None)
        proc.join(30)
        consumer.shutdown()
    gbs = [nbytes / s / 1e9 for s in single[1:]]
    return {"path": path, "payload": "plain memory" if foreign else "shared host buffer",
            "busy_loop": busy, "payload_bytes": nbytes, "fetch_s": single[1:],
            "gb_per_s": gbs, "median_gb_per_s": float(np.median(gbs)),
            "parallel": args.parallel, "parallel_wall_s": wall, "parallel_each_s": each,
            "parallel_aggregate_gb_per_s": nbytes * args.parallel / wall / 1e9}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--parallel", type=int, default=4, help="fetches at once")
    p.add_argument("--paths", default="tcp,shm", help=f"of {', '.join(PATHS)}")
    p.add_argument("--busy", action="store_true",
                   help="also time each with the consumer's process spinning in Python")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    for name in ("layers", "kv_heads", "head_dim", "tokens", "repeats", "parallel"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    args.paths = args.paths.split(",")
    if not args.paths or any(x not in PATHS for x in args.paths):
        p.error(f"--paths: a comma-separated list of {', '.join(PATHS)}")
    return args


def main() -> int:
    args = parse()
    runs = []
    for path in args.paths:
        for foreign in (False, True):
            for busy in (False, True) if args.busy else (False,):
                run = measure(args, path, foreign, busy)
                runs.append(run)
                print(f"{path:4} {run['payload']:18} busy={busy!s:5} "
                      f"{run['median_gb_per_s']:6.2f} GB/s one at a time, "
                      f"{run['parallel_aggregate_gb_per_s']:6.2f} GB/s x{args.parallel}",
                      flush=True)
    rec = record("kv-transfer", "shoal", device="cpu", layers=args.layers,
                 kv_heads=args.kv_heads, head_dim=args.head_dim, tokens=args.tokens,
                 repeats=args.repeats, runs=runs)
    write(rec, args.out or default_path("kv-transfer"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
