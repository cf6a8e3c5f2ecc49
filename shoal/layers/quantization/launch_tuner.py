"""The fastest of a few launch candidates per shape, timed once on the GPU.

A quantized layer at a few decode rows has several ways to run (weight-only GEMV strips of
different widths and K splits, the tensor-core kernel of methods.py) and which is fastest
depends on the GPU and the shape more than a rule can say. The first call of a shape key
outside a CUDA-graph capture (the engine's warm-up pass runs every captured shape eagerly
before capturing it) times each candidate, as the GPU runs it inside a graph of its own, and
keeps the fastest for the process; later calls, and the captured graph, use that one.
Candidates that fail to compile or launch (shared memory, a kernel the GPU compiler refuses)
or whose output is not the first candidate's (the heuristic's pick) are dropped; each distinct
failure is logged once as a warning (a candidate that cannot compile is a bug to see, but
not once per shape key). During a capture, on the CPU, or with
SHOAL_QUANT_TUNING=0, a key not timed yet takes its first candidate: the heuristic's pick.

The candidates are timed on the layer's own weights, call after call: a projection smaller
than the L2 stays there, where a decode step reads each layer's weights from memory once.
SHOAL_QUANT_TUNING_COLD=1 reads past the L2 before each timed call (gpu_time_us). On an
H100 (2026-12-07) it changed no step: benchmarks/int4_read_probe.py found warm timing picks
the INT4 tiles that are best cold, and W2 moved by under 1% (INT4 and FP8).

The choice is per process: two runs may pick different candidates of near-equal time, whose
float32 sums differ in order (outputs within rounding, not bit-equal across runs)."""

from __future__ import annotations

import functools
import logging
import statistics
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import torch

from shoal import envs

logger = logging.getLogger(__name__)

WARMUP, REPEATS = 3, 10
AGREE = 0.125  # relative norm error a candidate may show against the reference (_agrees)
# where every candidate computes from the same exact operands (the MXFP4 experts, the dense
# GEMVs: only float32 sums in another order, then one rounding): tight enough that a wrong
# strip of outputs or a dropped bias shows
EXACT_OPERANDS_AGREE = 2.0 ** -5


@dataclass
class Tuned:
    choice: str
    times_us: dict[str, float] = field(default_factory=dict)  # name -> median; failed: inf


TUNED: dict[Hashable, Tuned] = {}
_FAILURES_LOGGED: set[str] = set()  # failures warned of (type and message), once a process


def run_fastest(key: Hashable, names: Sequence[str], run: Callable[[str], torch.Tensor],
                device: torch.device, agree: float = AGREE) -> torch.Tensor:
    """run(name) for the fastest candidate name of key (see the module docstring); names in
    order of preference, each computing the same result (within `agree`, relative norm). Once
    key is timed this is a dict look-up and one call: the eager decode path calls it per layer
    and step."""
    known = TUNED.get(key)
    if known is None and may_time(device):
        known = TUNED[key] = _time(key, {name: functools.partial(run, name) for name in names},
                                   agree)
    return run(known.choice if known is not None else names[0])


def may_time(device: torch.device) -> bool:
    """Whether a first call on `device` may time its candidates now: a GPU, no CUDA-graph
    capture under way (a timing launch would be captured), SHOAL_QUANT_TUNING on."""
    return (device.type == "cuda" and not torch.cuda.is_current_stream_capturing()
            and envs.SHOAL_QUANT_TUNING.get())


def _time(key: Hashable, candidates: dict[str, Callable[[], torch.Tensor]],
          agree: float = AGREE) -> Tuned:
    first = next(iter(candidates))
    try:  # the heuristic's pick (the tested tensor-core kernel): what every candidate must give
        ref = candidates[first]().float()
    except Exception:  # (it cannot launch here: nothing to check the others against)
        ref = None
    times = {}
    for name, fn in candidates.items():
        t = gpu_time_us(fn, f"{key} {name}")
        if t != float("inf") and ref is not None and name != first \
                and not _agrees(fn, ref, f"{key} {name}", agree):
            t = float("inf")
        times[name] = t
    best = min(times, key=times.__getitem__)
    if times[best] == float("inf"):  # nothing could be timed: the heuristic's pick
        logger.warning("quantized %s: no launch candidate could be timed; using %s", key, first)
        return Tuned(first, times)
    logger.info("quantized %s: %s %.1f us (heuristic %s %.1f us, %d candidates)", key, best,
                times[best], first, times[first], len(times))
    return Tuned(best, times)


def _agrees(fn: Callable[[], torch.Tensor], ref: torch.Tensor, label: str,
            agree: float = AGREE) -> bool:
    """Whether a candidate computes what the reference does, up to `agree` in relative norm
    (AGREE: the FP8 tensor-core kernels round activations to FP8, the GEMVs do not: a few
    percent apart).
    A fast launch shape that computes garbage (a race, a wrong mask) must never be picked:
    the timing alone would not notice."""
    try:
        out = fn().float()
        err = (float((out - ref).norm() / ref.norm().clamp_min(1e-30))
               if out.shape == ref.shape else float("inf"))
    except Exception as e:  # noqa: BLE001 (a candidate that ran once may still fail: dropped)
        _log_failure(label, e)
        return False
    if bool(torch.isfinite(out).all()) and err <= agree:
        return True
    logger.warning("launch candidate %s disagrees with the reference (relative error %.3g): "
                   "dropped", label, err)
    return False


def gpu_time_us(fn: Callable[[], object], label: str = "", cold: bool | None = None) -> float:
    """Microseconds a call of fn takes on the GPU: REPEATS calls captured in one CUDA graph,
    the median of three replays. Timing eager calls instead would time this host's kernel
    launches (tens of microseconds each on a slow CPU), which favour fewer, slower kernels;
    the engine replays graphs. cold (default SHOAL_QUANT_TUNING_COLD): each call after a read
    of twice the L2 (that read's own time subtracted), so the weights come from memory as in
    a decode step, where a layer's weights are read once; warm, a projection smaller than the
    L2 (an 8B model's qkv and o) is timed at L2 bandwidth. inf: fn cannot compile, launch or
    be captured here, or its cold time is lost in the flush's noise."""
    stream = torch.cuda.current_stream()
    if cold is None:
        cold = envs.SHOAL_QUANT_TUNING_COLD.get()
    try:
        for _ in range(WARMUP):  # compiles, and settles any lazy allocation
            fn()
        torch.cuda.synchronize()
        if not cold:
            return graph_us(fn)
        flush = _l2_flush(torch.cuda.current_device())

        def flushed() -> None:
            flush()
            fn()

        cold_us = graph_us(flushed) - graph_us(flush)
        if cold_us > 0:
            return cold_us
        # lost in the flush's own noise: not comparable with the others' cold times, and not
        # free either (a warm time would mix the two measures)
        logger.debug("launch candidate %s: its cold time is lost in the L2 flush's noise", label)
        return float("inf")
    except Exception as e:  # noqa: BLE001 (a launch shape this GPU cannot run: not a candidate)
        _log_failure(label, e)
        # a capture that failed at its end leaves torch.cuda.graph's side stream current
        torch.cuda.set_stream(stream)
        torch.cuda.synchronize()
        return float("inf")


def graph_us(fn: Callable[[], object], repeats: int = REPEATS) -> float:
    """`repeats` calls of fn in one CUDA graph: the median of three replays, a call."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(repeats):
            fn()
    samples = []
    for _ in range(3):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / repeats)
    del graph
    return statistics.median(samples)


@functools.cache
def _l2_flush(device: int) -> Callable[[], object]:
    """A call that reads twice the L2 of GPU `device` (a sum into a kept scalar: no allocation
    inside a capture), leaving none of what was read before in L2. Made at the first cold
    timing and kept (twice the L2: ~100 MB on an H100), so that a later timing never
    allocates it after the KV cache has taken the memory."""
    size = 2 * max(torch.cuda.get_device_properties(device).L2_cache_size, 1 << 20)
    data = torch.ones(size // 4, dtype=torch.int32, device=f"cuda:{device}")
    out = torch.empty((), dtype=torch.int32, device=data.device)
    return functools.partial(torch.sum, data, 0, dtype=torch.int32, out=out)


def _log_failure(label: str, e: Exception) -> None:
    """A warning for the first candidate failing with this error, debug for the rest (the
    same kernel fails alike for every shape key) and for Triton's OutOfResources (a tile
    larger than this GPU's shared memory or registers: expected of some candidates)."""
    what = f"{type(e).__name__}: {e}"
    first = what not in _FAILURES_LOGGED and type(e).__name__ != "OutOfResources"
    _FAILURES_LOGGED.add(what)
    logger.log(logging.WARNING if first else logging.DEBUG,
               "launch candidate %s failed, dropped: %s", label, what)
