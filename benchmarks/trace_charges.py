"""Device time in a torch.profiler Chrome trace charged to the profiler ranges (record_function)
a script opened: each kernel (memcpy, memset) to the ranges open on the CPU thread that
launched it, matched through the launch's correlation id, and figures per step from those
charges. Used by step_profile_gpu.py, whose ranges are named PREFIX + "step <i> t=<tokens>",
"sample <i> t=<tokens>" (the runner's step and its sampling), MODEL (the decoder stack) and
a module kind ("experts", "norms", ...). Standard library only."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

PREFIX = "shoal::"
STEP, SAMPLE, MODEL = "step", "sample", "model"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


@dataclass
class Charge:
    """One device event (a kernel, memcpy or memset; on a CPU run an outermost CPU op)."""

    name: str
    us: float
    ranges: list[str]  # the enclosing shoal:: ranges at its launch, outermost first


@dataclass
class _Span:
    name: str
    start: float
    end: float


def _x_events(trace: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]


def _nested(spans: list[_Span], queries: list[tuple[float, int]]) -> dict[int, list[str]]:
    """For each query (time, id) the names of the spans (properly nested, one thread)
    open at that time, outermost first: one sweep in time order."""
    spans = sorted(spans, key=lambda s: (s.start, -s.end))
    out: dict[int, list[str]] = {}
    stack: list[_Span] = []
    i = 0
    for ts, qid in sorted(queries):
        while i < len(spans) and spans[i].start <= ts:
            while stack and stack[-1].end <= spans[i].start:
                stack.pop()
            stack.append(spans[i])
            i += 1
        while stack and stack[-1].end < ts:
            stack.pop()
        out[qid] = [s.name for s in stack]
    return out


def charges(trace: dict[str, Any]) -> list[Charge]:
    """Device events with the shoal:: ranges open on the CPU thread that launched them
    (matched through the launch's correlation id). A trace without device events (the CPU)
    charges its outermost CPU ops instead, to the ranges open around them."""
    events = _x_events(trace)
    ranges: dict[tuple[Any, Any], list[_Span]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(PREFIX):
            ts = float(e["ts"])
            ranges[(e.get("pid"), e.get("tid"))].append(
                _Span(e["name"][len(PREFIX):], ts, ts + float(e.get("dur", 0))))
    device = [e for e in events if e.get("cat") in DEVICE_CATS]
    if device:
        launch = {e["args"]["correlation"]: e for e in events
                  if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {})}
        sites = [launch.get(e.get("args", {}).get("correlation")) for e in device]
    else:  # the CPU: outermost CPU ops are the work
        device = _outermost([e for e in events if e.get("cat") == "cpu_op"])
        sites = list(device)
    by_thread: dict[tuple[Any, Any], list[tuple[float, int]]] = defaultdict(list)
    for i, site in enumerate(sites):
        if site is not None:
            by_thread[(site.get("pid"), site.get("tid"))].append((float(site["ts"]), i))
    names: dict[int, list[str]] = {}
    for thread, queries in by_thread.items():
        names.update(_nested(ranges.get(thread, []), queries))
    _inherit_steps(device, names)
    return [Charge(str(e.get("name", "?")), float(e.get("dur", 0)), names.get(i, []))
            for i, e in enumerate(device)]


def _inherit_steps(device: list[dict[str, Any]], names: dict[int, list[str]]) -> None:
    """A device event whose launch is not in the trace (a launch API the profiler did not
    record) runs in its stream's order: it takes the step or sample range of the event
    before it on its stream, as kind "unattributed", so that step totals stay whole."""
    streams: dict[tuple[Any, Any], list[int]] = defaultdict(list)
    for i, e in enumerate(device):
        streams[(e.get("pid"), e.get("tid"))].append(i)
    for order in streams.values():
        order.sort(key=lambda i: float(device[i]["ts"]))
        step: str | None = None
        for i in order:
            found = names.get(i) or []
            if found and step_of(found) is not None:
                step = found[0]
            elif not found and step is not None:
                names[i] = [step, "unattributed"]


def _outermost(ops: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """CPU ops not inside another CPU op of their thread."""
    out = []
    by_thread: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e.get("dur", 0))))
        end = -1.0
        for e in evs:
            if float(e["ts"]) >= end:
                out.append(e)
                end = float(e["ts"]) + float(e.get("dur", 0))
    return out


def step_of(names: list[str]) -> tuple[int, int] | None:
    """(step, tokens) of the outermost step / sample range."""
    for n in names:
        kind, _, rest = n.partition(" ")
        if kind in (STEP, SAMPLE) and rest:
            i, _, t = rest.partition(" t=")
            return int(i), int(t)
    return None


def kind_of(names: list[str]) -> str:
    """The innermost range's kind (step / sample / model: other_step, sampling,
    other_model)."""
    if not names:
        return "unattributed"
    inner = names[-1].split(" ", 1)[0]
    return {STEP: "other_step", SAMPLE: "sampling", MODEL: "other_model"}.get(inner, inner)


@dataclass
class StepFigures:
    steps: int
    us_per_step: float
    kernels_per_step: float
    by_kind: dict[str, dict[str, float]] = field(default_factory=dict)
    by_kernel: list[dict[str, Any]] = field(default_factory=list)


def per_step(items: Iterable[Charge], steps: int, top: int, by_kind: bool = True
             ) -> StepFigures:
    """Sums per step of `steps`: by kind (us, kernels) and the top kernels by name."""
    kinds: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    total, count = 0.0, 0
    for c in items:
        total += c.us
        count += 1
        k = kinds[kind_of(c.ranges)]
        k[0] += c.us
        k[1] += 1
        n = kernels[c.name]
        n[0] += c.us
        n[1] += 1
    steps = max(steps, 1)
    order = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    return StepFigures(
        steps=steps, us_per_step=total / steps, kernels_per_step=count / steps,
        by_kind={k: {"us": v[0] / steps, "kernels": v[1] / steps,
                     "share": v[0] / total if total else 0.0}
                 for k, v in sorted(kinds.items(), key=lambda kv: -kv[1][0])} if by_kind
        else {},
        by_kernel=[{"name": name[:200], "us_per_step": v[0] / steps,
                    "calls_per_step": v[1] / steps, "us_per_call": v[0] / v[1]}
                   for name, v in order])


def decode_figures(all_charges: list[Charge], batch: int, top: int) -> StepFigures:
    """The steps that ran `batch` tokens (decode at that batch), their sampling included."""
    chosen: list[Charge] = []
    steps: set[int] = set()
    for c in all_charges:
        s = step_of(c.ranges)
        if s is not None and s[1] == batch:
            chosen.append(c)
            steps.add(s[0])
    return per_step(chosen, len(steps), top)
