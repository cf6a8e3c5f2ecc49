"""Timing a callable on the GPU for the kernel tests that print their speed (CUDA events)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def time_ms(fn: Callable[[], object], iters: int = 50) -> float:
    """Mean milliseconds of fn() over `iters` calls, after three warm-up calls."""
    for _ in range(3):
        fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters


def graph_of_calls(fn: Callable[[], object], calls: int = 20
                   ) -> tuple[Callable[[], object], int]:
    """(replay, calls): a CUDA graph of `calls` back-to-back calls of fn (after one eager
    call that compiles it), for device time per call as inside a decode step's graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay, calls
