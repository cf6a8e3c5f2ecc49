"""The one place the benchmark scripts reach into the engine, for figures the public API does
not give (step counts, CUDA-graph replay time, start-up stages, forcing a drafter's rate).

These are shoal internals (`LLM.llm_engine.core.runner`, ...) that the seams refactor moves,
so every accessor returns None where the path is gone instead of failing the run, and always
under SHOAL_BENCH_PUBLIC_ONLY=1: the before/after sweep (gpu_run.sh --trees) measures both
trees with the public API alone, the same way. Scripts whose whole measurement is internal
(w6_cpu_profile.py, w5_prefix_reuse.py, ...) call core(llm, required=True)."""

from __future__ import annotations

import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


def public_only() -> bool:
    return os.environ.get("SHOAL_BENCH_PUBLIC_ONLY") == "1"


def core(llm: Any, required: bool = False) -> Any | None:
    """The engine core of an offline LLM (shoal at ffd2572: llm.llm_engine.core)."""
    found = None if public_only() else getattr(getattr(llm, "llm_engine", None), "core", None)
    if found is None and required:
        raise RuntimeError("this measurement needs the engine core (llm.llm_engine.core): "
                           "not available" + (" under SHOAL_BENCH_PUBLIC_ONLY=1"
                                              if public_only() else " in this tree"))
    return found


def runner(llm: Any) -> Any | None:
    return getattr(core(llm), "runner", None)


def vocab_size(llm: Any) -> int | None:
    return getattr(core(llm), "vocab_size", None)


def startup_stages(llm: Any) -> Any | None:
    return getattr(runner(llm), "startup_times", None)


def graph_replay_ms(llm: Any, batch: int = 1, iters: int = 50) -> float | None:
    """GPU time of one replay of the decode CUDA graph for `batch` rows."""
    import torch

    graphs = getattr(runner(llm), "graphs", None)
    table = getattr(getattr(graphs, "table", None), "graphs", None)  # one table by step shape
    key: Any = next((s for s in table or () if s.rows == batch and s.q == 1), None)
    if table is None:  # trees before the seams refactor: decode graphs by batch size
        table, key = getattr(graphs, "graphs", None), batch
    if not torch.cuda.is_available() or not table or key not in table:
        return None
    g = table[key]
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1000


@contextmanager
def step_counter(llm: Any) -> Iterator[list[int] | None]:
    """Counts the non-empty steps the runner launches while inside (counter[0]); yields None
    where the runner's execute (launch before the seams refactor) cannot be wrapped."""
    run = runner(llm)
    name = "execute" if hasattr(run, "execute") and hasattr(run, "sample") else "launch"
    launch = getattr(run, name, None)
    if launch is None:
        yield None
        return
    counter = [0]
    own = vars(run).get(name)  # an instance attribute to put back, if there was one

    def counted(sched: Any) -> Any:
        if not getattr(sched, "is_empty", False):
            counter[0] += 1
        return launch(sched)

    setattr(run, name, counted)
    try:
        yield counter
    finally:
        if own is not None:
            setattr(run, name, own)
        else:
            delattr(run, name)  # the class's method again


def set_forced_acceptance(llm: Any, rate: float) -> bool:
    """test_forced_acceptance's share of drafts to accept, changed on a running engine;
    False where that cannot be done (then build one engine per rate)."""
    run = runner(llm)
    proposer = getattr(run, "drafter", None) or getattr(run, "proposer", None)
    if proposer is None or not hasattr(proposer, "rate"):
        return False
    proposer.rate = rate
    return True


class MethodTimers:
    """perf_counter wrappers around engine methods: calls[name] lists each call's seconds;
    restore() puts the originals back (an instance attribute, or the class's method)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = defaultdict(list)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, obj: Any, attr: str, name: str | None = None) -> None:
        own = vars(obj).get(attr)  # an instance attribute to put back, if there was one
        orig, calls = getattr(obj, attr), self.calls[name or attr]

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                calls.append(time.perf_counter() - t0)

        setattr(obj, attr, timed)
        self._undo.append(lambda: setattr(obj, attr, own) if own is not None
                          else delattr(obj, attr))

    def sums(self) -> dict[str, float]:
        return {name: sum(v) for name, v in self.calls.items()}

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
