"""The load loop of `shoal bench serve`: arrival times, concurrency, client processes.

One process: one asyncio loop sends every request at its arrival time, at most
`max_concurrency` in flight. Several (`--num-client-processes N`): the requests are dealt out
round robin, the concurrency split evenly, each process runs the same loop on its share from
one common start time (perf_counter is the machine's monotonic clock, the same in every
process), and the outputs come back in the original order. Use it when one process cannot
parse the event rate (see benchmarks/README.md, "load generator ceiling").
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from typing import Any

import numpy as np

from shoal.benchmarks.http_client import HTTPClient
from shoal.benchmarks.request_funcs import RequestInput, RequestOutput, send_request


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0
                  ) -> list[float]:
    """Seconds from the start at which each request is sent."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {burstiness}")
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    if request_rate == float("inf") or n == 0:
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    times = np.cumsum(gaps)
    times *= (n / request_rate) / times[-1]  # the run lasts exactly n / rate
    return times.tolist()


class Progress:
    def __init__(self, total: int, disable: bool) -> None:
        self.bar = None
        if not disable:
            from tqdm import tqdm

            self.bar = tqdm(total=total, smoothing=0.1)

    def update(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def set_to(self, n: int) -> None:
        if self.bar is not None and n > self.bar.n:
            self.bar.update(n - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


async def run_requests(client: HTTPClient, inputs: list[RequestInput], arrivals: list[float],
                       max_concurrency: int | None, start_at: float | None = None,
                       on_done: Any = None) -> tuple[list[RequestOutput], float, float]:
    """Send `inputs[i]` at `start_at + arrivals[i]` (perf_counter seconds) with at most
    `max_concurrency` in flight. Returns the outputs in order, the start and the end."""
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    if start_at is None:
        start_at = time.perf_counter()
    delay = start_at - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)

    async def one(inp: RequestInput, arrived: float) -> RequestOutput:
        if sem is None:
            out = await send_request(client, inp, on_done)
        else:
            async with sem:
                out = await send_request(client, inp, on_done)
        out.client_queue_time = max(0.0, out.start_time - arrived)
        return out

    tasks = []
    for inp, t in zip(inputs, arrivals):
        wait = start_at + t - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        tasks.append(asyncio.create_task(one(inp, time.perf_counter())))
    outputs = await asyncio.gather(*tasks)
    return list(outputs), start_at, time.perf_counter()


def make_client(base_url: str, headers: dict[str, str], insecure: bool) -> HTTPClient:
    return HTTPClient(base_url, headers=headers, verify_ssl=not insecure)


def _worker(base_url: str, headers: dict[str, str], insecure: bool,
            inputs: list[RequestInput], arrivals: list[float], max_concurrency: int | None,
            counter: Any, conn: Any) -> None:
    """One client process: report ready, wait for the common start time, run, send back."""
    def bump() -> None:
        with counter.get_lock():
            counter.value += 1

    async def go() -> tuple[list[RequestOutput], float, float]:
        client = make_client(base_url, headers, insecure)
        try:
            conn.send("ready")
            start_at = conn.recv()
            return await run_requests(client, inputs, arrivals, max_concurrency, start_at,
                                      bump)
        finally:
            await client.close()

    try:
        conn.send(("ok", asyncio.run(go())))
    except BaseException as e:  # report, do not hang the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        conn.close()


def run_multiprocess(base_url: str, headers: dict[str, str], insecure: bool,
                     inputs: list[RequestInput], arrivals: list[float],
                     max_concurrency: int | None, processes: int, progress: Progress
                     ) -> tuple[list[RequestOutput], float]:
    """Round-robin the requests over `processes` clients, each with its share of the
    concurrency, started together; outputs come back in the original order."""
    if max_concurrency is not None:
        processes = min(processes, max_concurrency)
    processes = max(1, min(processes, len(inputs)))
    ctx = mp.get_context("spawn")  # no forked tokenizer threads or event loops
    counter = ctx.Value("i", 0)
    procs, pipes = [], []
    for w in range(processes):
        idx = list(range(w, len(inputs), processes))
        share = None
        if max_concurrency is not None:
            share = max_concurrency // processes + (1 if w < max_concurrency % processes else 0)
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, daemon=True, args=(
            base_url, headers, insecure, [inputs[i] for i in idx], [arrivals[i] for i in idx],
            share, counter, child))
        proc.start()
        child.close()
        procs.append((proc, idx))
        pipes.append(parent)
    try:
        for pipe in pipes:
            msg = pipe.recv()
            if msg != "ready":
                raise RuntimeError(f"client process failed to start: {msg}")
        start_at = time.perf_counter() + 0.05
        for pipe in pipes:
            pipe.send(start_at)
        outputs: list[RequestOutput | None] = [None] * len(inputs)
        end = start_at
        pending = dict(enumerate(pipes))
        while pending:
            for w, pipe in list(pending.items()):
                if pipe.poll(0.05):
                    status, payload = pipe.recv()
                    if status != "ok":
                        raise RuntimeError(f"client process {w} failed: {payload}")
                    outs, _, w_end = payload
                    for i, out in zip(procs[w][1], outs):
                        outputs[i] = out
                    end = max(end, w_end)
                    del pending[w]
            progress.set_to(counter.value)
    finally:
        for proc, _ in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
    assert all(o is not None for o in outputs)
    return [o for o in outputs if o is not None], end - start_at
