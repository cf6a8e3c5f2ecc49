"""Where the host time of a structured-outputs engine step goes (issue 15).

    .venv/bin/python benchmarks/structured_host_costs.py --out /tmp/so-host.json   # CPU
    python benchmarks/structured_host_costs.py --out $OUT/x.json                  # CUDA host

A tiny random Llama (2 layers, hidden 64, load_format="dummy") with SmolLM2's tokenizer
(49,152 tokens) runs on CUDA when there is one, else on the CPU, so the model's own time is
small and a step is mostly host work. Its logits are 151,936 wide on CUDA (Qwen3's, as in
benchmarks/structured_outputs_gpu.py, which pads SmolLM2's tokenizer the same way) and the
tokenizer's width on the CPU (--vocab-size). At each batch size, requests with 16-token
prompts decode (a finished one is replaced at once, so every step samples `batch` rows):
  free-async  unconstrained, async scheduling (the CUDA default; on the CPU via --modes)
  free-sync   unconstrained, one step at a time (what a structured request forced before they were pipelined)
  json        the JSON schema of structured_outputs_gpu.py on every request
Per mode and batch size, N steps are timed bare (EngineCore.step: the clean step time), then
N more with perf_counter wrappers for a breakdown; only steady decode steps count (since
2026-12-04): a json request ends when its JSON closes and is replaced, and the steps that
prefill the replacement (and, with async scheduling, the step after, which applies its
results) are left out (prefill_steps_left_out), as the unconstrained runs, whose requests
never end, have none. The breakdown: schedule, the core's list of bitmask rows,
the runner's launch (inputs, forward, sampling metadata, the bitmask fill and inside it the
backend's batch fill, apply_token_bitmask, the sampler), finish (on CUDA: the wait for the
device), update (inside it _check_grammar: the matchers' accept_token + is_terminated) and
the rest of step(). A cProfile of a few json steps at the largest batch gives the top entries
by tottime and cumulative time. Then xgrammar alone, at each bitmask width of
--xgr-vocab-sizes (0: the tokenizer's; 151936 pads it with 102,784 ids xgrammar counts as
special tokens): N matchers of one compiled grammar inside the JSON string, the batch fill
serial / on 1..8 threads, shoal's manager fill, accept_token per row, is_terminated, and
apply_token_bitmask against xgrammar's own kernel.

On the CPU the "device" work (forward, sampler, isfinite, apply_token_bitmask) is host compute
as well, and sampling is greedy by default (drawing from 49k-wide rows costs more than all the
grammar work there); on CUDA the wrappers measure host time only, except finish, which waits.
Imports the engine only (no server, no pydantic)."""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import engine_internals
from bench_args import REQUIRED, add_common, comma_ints
from offline_runs import tiny_llama
from results_file import cpu_model, hardware, provenance, write

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # shoal, after any PYTHONPATH
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# As in benchmarks/structured_outputs_gpu.py: the string field never has to end.
SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["note", "task"]},
    "text": {"type": "string"}},
    "required": ["kind", "text"]}
PROMPT_LEN = 16
MODES = ("free-async", "free-sync", "json")
# Timer names: top-level parts of a step, then parts inside them (nested: not added up).
TOP = ("schedule", "core_grammar_rows", "launch", "finish", "update")
NESTED = {"launch": ("prepare_inputs", "forward", "sampling_metadata", "fill_bitmask",
                     "xgr_batch_fill", "apply_token_bitmask", "sampler"),
          "update": ("check_grammar",)}


def ms(seconds: float) -> float:
    return round(1e3 * seconds, 4)


def us(seconds: float) -> float:
    return round(1e6 * seconds, 3)


# ---- the engine --------------------------------------------------------------------------
def pick_tokenizer(ns: argparse.Namespace) -> Any:
    """SmolLM2's tokenizer: --tokenizer, else the embedded model's, else the folder the H200
    runs of structured_outputs_gpu.py used (bench-work/qwen3-0.6b-smol). Sets ns.tokenizer."""
    from shoal.loader.tokenizers import load_tokenizer

    tried = [ns.tokenizer] if ns.tokenizer else ["smollm2", str(ROOT / "bench-work" /
                                                             "qwen3-0.6b-smol")]
    errors = []
    for name in tried:
        try:
            tok = load_tokenizer(name)
        except Exception as e:  # noqa: BLE001 - the next candidate, then all reasons
            errors.append(f"{name}: {type(e).__name__}: {e}")
            continue
        ns.tokenizer = name
        return tok
    raise SystemExit("no SmolLM2 tokenizer (pass --tokenizer FOLDER): " + "; ".join(errors))


def build_llm(ns: argparse.Namespace, device: str, max_batch: int, folder: Path) -> Any:
    from shoal import LLM

    tok = pick_tokenizer(ns)
    vocab = max(ns.vocab_size or 0, len(tok))
    tiny_llama(folder, vocab, tok.eos_token_id if tok.eos_token_id is not None else 2)
    max_len = 1024
    cuda = device.startswith("cuda")
    return LLM(model=str(folder), tokenizer=ns.tokenizer, load_format="dummy", device=device,
               dtype="bfloat16" if cuda else "float32", max_model_len=max_len,
               max_num_seqs=max_batch, max_num_batched_tokens=max(8192, max_batch * 64),
               enable_prefix_caching=False, block_size=16,
               num_gpu_blocks_override=max_batch * (max_len // 16) // 4 + 256,
               structured_outputs_config='{"backend": "xgrammar"}',
               **({} if cuda else {"cpu_threads": ns.cpu_threads}))


def install_timers(core: Any) -> engine_internals.MethodTimers:
    import shoal.worker.model_runner as mr

    t = engine_internals.MethodTimers()
    runner, sched = core.runner, core.scheduler
    t.wrap(sched, "schedule", "schedule")
    t.wrap(core, "_grammar_bitmask", "core_grammar_rows")
    t.wrap(runner, "launch", "launch")
    t.wrap(runner, "finish", "finish")
    t.wrap(sched, "update", "update")
    t.wrap(sched, "_check_grammar", "check_grammar")  # accept + is_terminated per row
    t.wrap(runner, "_prepare_inputs", "prepare_inputs")
    t.wrap(runner, "_forward", "forward")
    t.wrap(runner, "sampler", "sampler")
    t.wrap(mr.SamplingMetadata, "build", "sampling_metadata", static=True)
    t.wrap(mr, "apply_token_bitmask", "apply_token_bitmask")
    t.wrap(core.structured, "fill_bitmask", "fill_bitmask")
    t.wrap(core.structured._get_backend(), "fill_bitmasks", "xgr_batch_fill")
    return t


class Driver:
    """Keeps `batch` requests of one mode decoding: finished ones are replaced at once."""

    def __init__(self, core: Any, mode: str, batch: int, max_tokens: int,
                 temperature: float):
        from shoal.sampling_params import SamplingParams
        from shoal.structured_output.params import StructuredOutputsParams

        self.core, self.mode, self.batch = core, mode, batch
        so = (StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
              if mode == "json" else None)
        self.params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                     ignore_eos=True, structured_outputs=so)
        self.live: set[str] = set()
        self.count = 0
        self.replaced = 0
        self.vocab = core.vocab_size
        # Calls left until a step without a new request's prefill: the step after a top-up
        # prefills, and with async scheduling the call after it applies that step's results.
        self.fresh = 0
        self.last_steady = False  # the last step() was a steady decode step

    def top_up(self) -> None:
        from shoal.engine.core_types import EngineCoreRequest

        while len(self.live) < self.batch:
            self.fresh = 2
            i = self.count
            self.count += 1
            rid = f"{self.mode}-{self.batch}-{i}"
            prompt = [(7919 * (i * PROMPT_LEN + j)) % (self.vocab - 3) + 3
                      for j in range(PROMPT_LEN)]
            self.core.add_request(EngineCoreRequest(rid, prompt, self.params.clone(),
                                                    time.monotonic()))
            self.live.add(rid)

    def step(self) -> tuple[int, float]:
        """One engine step: (rows that sampled, seconds); last_steady says whether it was a
        steady decode step (no prefill of a replacement request in it)."""
        self.last_steady = self.fresh == 0
        self.fresh = max(0, self.fresh - 1)
        t0 = time.perf_counter()
        out = self.core.step()
        dt = time.perf_counter() - t0
        rows = 0
        for o in out.outputs:
            rows += len(o.new_token_ids)
            if o.finish_reason is not None:
                self.live.discard(o.request_id)
                self.replaced += 1
        self.top_up()
        return rows, dt

    def drain(self) -> None:
        self.core.abort_requests(sorted(self.live))
        self.live.clear()
        while self.core.has_unfinished_requests():
            self.core.step()


def time_mode(core: Any, mode: str, batch: int, steps: int, async_default: bool,
              temperature: float) -> dict[str, Any]:
    core.async_scheduling = async_default if mode == "free-async" else False
    if mode == "free-async" and not async_default:
        core.async_scheduling = True  # on the CPU too: the same code path, nothing overlaps
    d = Driver(core, mode, batch, 1024 - PROMPT_LEN - 8, temperature)
    d.top_up()
    try:
        for _ in range(200):  # until the whole batch decodes (grammar compiled, prefilled)
            rows, _ = d.step()
            if rows == batch and d.core.scheduler.num_waiting == 0:
                break
        for _ in range(max(2, steps // 4)):  # warm-up
            d.step()
        clean, left_out = [], 0
        for _ in range(steps):
            rows, dt = d.step()
            if d.last_steady:
                clean.append((rows, dt))
            else:
                left_out += 1
        timers = install_timers(core)
        per_step: list[dict[str, float]] = []
        timed = []
        try:
            for _ in range(steps):
                timers.clear()
                rows, dt = d.step()
                if d.last_steady:
                    timed.append((rows, dt))
                    per_step.append(timers.sums())
                else:
                    left_out += 1
        finally:
            timers.restore()
    finally:
        d.drain()
        core.async_scheduling = async_default
    if not clean or not timed:  # every step had a prefill
        raise SystemExit(f"{mode} at batch {batch}: no steady decode step of {steps}; "
                         "more --steps")
    r = summarize(mode, batch, clean, timed, per_step, d.replaced)
    r["prefill_steps_left_out"] = left_out
    return r


def summarize(mode: str, batch: int, clean: list[tuple[int, float]],
              timed: list[tuple[int, float]], per_step: list[dict[str, float]],
              replaced: int) -> dict[str, Any]:
    def med(values: list[float]) -> float:
        return statistics.median(values) if values else 0.0

    names = set(TOP) | {n for sub in NESTED.values() for n in sub}
    mean = {n: statistics.fmean(s.get(n, 0.0) for s in per_step) for n in names}
    step_mean = statistics.fmean(dt for _, dt in timed)
    breakdown = {n: ms(mean[n]) for n in TOP}
    breakdown["step_other"] = ms(step_mean - sum(mean[n] for n in TOP))
    nested = {parent: {n: ms(mean[n]) for n in kids} for parent, kids in NESTED.items()}
    launch_known = sum(mean[n] for n in ("prepare_inputs", "forward", "sampling_metadata",
                                         "fill_bitmask", "apply_token_bitmask", "sampler"))
    nested["launch"]["launch_other"] = ms(mean["launch"] - launch_known)
    nested["launch"]["fill_bitmask_outside_xgr"] = ms(mean["fill_bitmask"]
                                                      - mean["xgr_batch_fill"])
    nested["update"]["update_other"] = ms(mean["update"] - mean["check_grammar"])
    grammar = mean["core_grammar_rows"] + mean["fill_bitmask"] + mean["apply_token_bitmask"] \
        + mean["check_grammar"]
    return {
        "mode": mode, "batch": batch,
        "rows_per_step": sorted({r for r, _ in clean + timed}),
        "requests_replaced": replaced,
        "clean_step_ms_mean": ms(statistics.fmean(dt for _, dt in clean)),
        "clean_step_ms_median": ms(med([dt for _, dt in clean])),
        "clean_step_ms_min": ms(min(dt for _, dt in clean)),
        "timed_step_ms_mean": ms(step_mean),
        "timed_step_ms_median": ms(med([dt for _, dt in timed])),
        "breakdown_ms": breakdown,
        "nested_ms": nested,
        "grammar_total_ms": ms(grammar),
        "grammar_per_row_us": us(grammar / batch),
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per batch size: each mode's clean median step, and the json run's grammar parts."""
    out: dict[str, dict[str, float]] = {}
    for r in runs:
        row = out.setdefault(str(r["batch"]), {})
        row[f"{r['mode']}_step"] = r["clean_step_ms_median"]
        row[f"{r['mode']}_step_min"] = r["clean_step_ms_min"]
        if r["mode"] == "json":
            launch, update = r["nested_ms"]["launch"], r["nested_ms"]["update"]
            row.update({
                "json_fill_bitmask": launch["fill_bitmask"],
                "json_xgr_batch_fill": launch["xgr_batch_fill"],
                "json_apply_token_bitmask": launch["apply_token_bitmask"],
                "json_check_grammar": update["check_grammar"],
                "json_core_grammar_rows": r["breakdown_ms"]["core_grammar_rows"],
                "json_grammar_total": r["grammar_total_ms"]})
    return out


def profile_steps(core: Any, batch: int, steps: int, temperature: float, top: int = 25
                  ) -> dict[str, Any]:
    d = Driver(core, "json", batch, 1024 - PROMPT_LEN - 8, temperature)
    d.top_up()
    try:
        for _ in range(200):
            rows, _ = d.step()
            if rows == batch:
                break
        for _ in range(3):
            d.step()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            d.step()
        prof.disable()
    finally:
        d.drain()
    stats = pstats.Stats(prof, stream=io.StringIO())
    out = {}
    for key in ("tottime", "cumulative"):
        stats.sort_stats(key)
        rows = []
        for func in stats.fcn_list[:top]:  # type: ignore[attr-defined]
            cc, nc, tt, ct, _ = stats.stats[func]  # type: ignore[attr-defined]
            file, line, name = func
            rows.append({"function": f"{_short(file)}:{line}({name})", "ncalls": nc,
                         "tottime_ms_per_step": ms(tt / steps),
                         "cumtime_ms_per_step": ms(ct / steps)})
        out["top_by_" + key] = rows
    return {"batch": batch, "steps": steps, **out}


def _short(path: str) -> str:
    for marker in ("/shoal/", "/site-packages/", "/lib/python"):
        i = path.rfind(marker)
        if i >= 0:
            return path[i + 1:]
    return path


# ---- xgrammar alone ----------------------------------------------------------------------
def xgrammar_pieces(core: Any, sizes: list[int], vocab: int, device: str, repeats: int
                    ) -> dict[str, Any]:
    """xgrammar's pieces with a bitmask (and TokenizerInfo) `vocab` tokens wide, through a
    StructuredOutputManager of its own, as the engine builds it."""
    import numpy as np
    import xgrammar as xgr

    from shoal.structured_output.manager import StructuredOutputManager
    from shoal.structured_output.params import StructuredOutputsParams
    from shoal.structured_output.xgrammar_backend import fill_threads

    eng = core.structured
    manager = StructuredOutputManager("xgrammar", eng._tokenizer, vocab, eng._eos,
                                      pin_memory=device.startswith("cuda"))
    params = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    t0 = time.perf_counter()
    manager._get_backend()  # TokenizerInfo from the tokenizer, as the engine does
    setup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    manager.validate(params)  # compiles (cached for the requests below)
    compile_s = time.perf_counter() - t0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    thread_counts = sorted({1, 2, 4, 8, fill_threads()} & set(range(1, (cpus or 1) + 1)))
    batchers = {k: xgr.BatchGrammarMatcher(max_threads=k) for k in thread_counts}
    info = manager._future(params).result()[1].tokenizer_info
    out: dict[str, Any] = {
        "vocab": vocab, "bitmask_words": -(-vocab // 32),
        "special_token_ids": len(info.special_token_ids),
        "backend_setup_ms": ms(setup_s), "compile_ms": ms(compile_s),
        "fill_threads_default": fill_threads(), "cpus": cpus,
        "timing": f"best of {repeats} calls, microseconds", "by_n": {}}
    rng = np.random.default_rng(0)
    for n in sizes:
        out["by_n"][str(n)] = _pieces_at(n, manager, params, batchers, rng, device, repeats)
    manager.shutdown()
    return out


def _best(fn: Callable[[], Any], repeats: int) -> float:
    """Least seconds of `repeats` calls after a warm one (the machine may be shared)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def _walk(ms_: list[Any], bm: Any, batcher: Any, rng: Any, steps: int) -> list[list[int]]:
    """Advances every matcher `steps` allowed tokens drawn at random (never its end);
    returns the tokens of each step."""
    import numpy as np

    path = []
    for _ in range(steps):
        batcher.batch_fill_next_token_bitmask(ms_, bm)
        bits = np.unpackbits(bm.numpy().view(np.uint8), axis=1, bitorder="little")
        toks = []
        for i, m in enumerate(ms_):
            tok = -1
            for cand in rng.permutation(np.flatnonzero(bits[i]))[:16]:
                if m.accept_token(int(cand)):
                    if m.is_terminated():
                        m.rollback(1)
                        continue
                    tok = int(cand)
                    break
            if tok < 0:  # nothing but the end: stay (accept nothing this step)
                tok = -1
            toks.append(tok)
        path.append(toks)
    return path


def _pieces_at(n: int, manager: Any, params: Any, batchers: dict[int, Any], rng: Any,
               device: str, repeats: int) -> dict[str, Any]:
    """n matchers of one compiled grammar, each some 24 tokens into the JSON (in the string)."""
    import torch
    import xgrammar as xgr

    from shoal.structured_output import xgrammar_backend as xb

    backend = manager._get_backend()
    vocab = manager.vocab_size
    words = -(-vocab // 32)
    reqs = [manager.request(params) for _ in range(n)]
    for r in reqs:
        r.settle()
    ms_ = [r.matcher._m for r in reqs]  # type: ignore[attr-defined]
    bm = torch.empty(n, words, dtype=torch.int32, pin_memory=device.startswith("cuda"))
    _walk(ms_, bm, batchers[1], rng, 24)
    # The next 8 tokens of each, accepted and rolled back while timing.
    ahead = _walk(ms_, bm, batchers[1], rng, 8)
    for toks in reversed(ahead):
        for m, tok in zip(ms_, toks):
            if tok >= 0:
                m.rollback(1)
    batchers[1].batch_fill_next_token_bitmask(ms_, bm)
    allowed = float(torch.bitwise_and(bm.view(torch.uint8).unsqueeze(-1),
                                      torch.tensor([1 << k for k in range(8)],
                                                   dtype=torch.uint8)).ne(0).float().mean())

    def serial_fill() -> None:
        for i, m in enumerate(ms_):
            m.fill_next_token_bitmask(bm, i)

    res: dict[str, Any] = {"allowed_fraction": round(allowed, 4)}
    res["memset_fill_-1_us"] = us(_best(lambda: bm.fill_(-1), repeats))
    res["serial_fill_us"] = us(_best(serial_fill, repeats))
    for k, b in batchers.items():
        res[f"batch_fill_{k}_threads_us"] = us(_best(
            lambda b=b: b.batch_fill_next_token_bitmask(ms_, bm), repeats))
    res["shoal_backend_fill_bitmasks_us"] = us(_best(
        lambda: backend.fill_bitmasks([r.matcher for r in reqs], bm), repeats))
    res["shoal_manager_fill_bitmask_us"] = us(_best(lambda: manager.fill_bitmask(reqs),
                                                    repeats))
    # the engine's: one thread below THREADED_FILL_ROWS rows (absent before 2026-12-04)
    threads = xb.fill_threads() if n >= getattr(xb, "THREADED_FILL_ROWS", 0) else 1
    res["fill_per_row_us_default_threads"] = round(
        res[f"batch_fill_{threads}_threads_us"] / n, 3)

    def accept(kind: str) -> tuple[float, float]:
        """Seconds to accept the 8 tokens ahead (per step, all rows), then to roll back."""
        t0 = time.perf_counter()
        for toks in ahead:
            if kind == "raw":
                for m, tok in zip(ms_, toks):
                    if tok >= 0:
                        m.accept_token(tok)
            elif kind == "shoal":  # the scheduler's _check_grammar: accept, then ended
                for r, tok in zip(reqs, toks):
                    if tok >= 0 and r.accept(tok) and r.ended:
                        pass
            else:
                pairs = [(m, tok) for m, tok in zip(ms_, toks) if tok >= 0]
                xgr.BatchGrammarMatcher.batch_accept_token([m for m, _ in pairs],
                                                           [t for _, t in pairs])
        t1 = time.perf_counter()
        for toks in reversed(ahead):
            for m, tok in zip(ms_, toks):
                if tok >= 0:
                    m.rollback(1)
        return (t1 - t0) / len(ahead), time.perf_counter() - t1

    for name, kind in (("accept_token_loop", "raw"),
                       ("shoal_accept_and_is_terminated_loop", "shoal"),
                       ("batch_accept_token", "batch")):
        accept(kind)
        pairs = [accept(kind) for _ in range(max(3, repeats // 3))]
        res[f"{name}_us_per_step"] = us(min(p[0] for p in pairs))
    res["is_terminated_loop_us"] = us(_best(lambda: [m.is_terminated() for m in ms_],
                                            repeats))
    res["apply_token_bitmask"] = apply_costs(bm, n, vocab, device, repeats)
    return res


def apply_costs(bm: Any, n: int, vocab: int, device: str, repeats: int) -> dict[str, Any]:
    """Masking float logits [n, vocab] on the device with shoal's apply_token_bitmask (the
    host's time to queue it on CUDA, and with a synchronize), and with xgrammar's kernel."""
    import torch

    from shoal.structured_output.bitmask import apply_token_bitmask

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    logits = torch.zeros(n, vocab, dtype=dtype, device=device)
    rows = list(range(n))
    half = list(range(0, n, 2))

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def run(words: Any, which: list[int], wait: bool) -> Callable[[], None]:
        def fn() -> None:
            apply_token_bitmask(logits, words, which)
            if wait:
                sync()
        return fn

    res: dict[str, Any] = {"shoal_all_rows_us": us(_best(run(bm, rows, True), repeats))}
    if half and len(half) < n:
        res["shoal_half_rows_us"] = us(_best(run(bm[:len(half)], half, True), repeats))
    if device.startswith("cuda"):
        sync()
        res["shoal_all_rows_host_only_us"] = us(_best(run(bm, rows, False), repeats))
        sync()
    try:
        import xgrammar as xgr

        dev_bm = bm.to(device)

        def xgr_apply() -> None:
            xgr.apply_token_bitmask_inplace(logits, dev_bm)
            sync()

        res["xgrammar_apply_inplace_us"] = us(_best(xgr_apply, repeats))
    except Exception as e:  # noqa: BLE001 - a missing kernel (no nvcc/triton) is reported
        res["xgrammar_apply_inplace_error"] = f"{type(e).__name__}: {str(e)[:160]}"
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common(p, out=REQUIRED, device=None)
    p.add_argument("--batch-sizes", type=comma_ints, default=[1, 64, 256])
    p.add_argument("--steps", type=int, default=0,
                   help="timed steps per mode and batch size, clean and with timers each "
                        "(default: CUDA 40, 30 past batch 64; CPU 30, 10 past batch 64)")
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--repeats", type=int, default=15, help="repeats of each xgrammar timing")
    p.add_argument("--tokenizer", default=None,
                   help="SmolLM2's tokenizer: a known name or a folder (default: smollm2, "
                        "the embedded model's, else bench-work/qwen3-0.6b-smol)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the engine model's vocabulary (logits width), at least the "
                        "tokenizer's (default: 151936 as Qwen3's on CUDA, the tokenizer's on "
                        "the CPU)")
    p.add_argument("--xgr-vocab-sizes", default="0,151936",
                   help="bitmask widths for the xgrammar-alone timings (0: the tokenizer's)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: 0.6 as W1 on CUDA; 0 on the CPU, "
                        "where drawing from 49k-wide rows costs more than the grammar)")
    p.add_argument("--cpu-threads", type=int, default=1,
                   help="torch threads on the CPU (1: a parallel op on a shared machine "
                        "waits for its slowest thread)")
    p.add_argument("--modes", default=None,
                   help="default: free-async,free-sync,json on CUDA; free-sync,json on the "
                        "CPU (nothing overlaps there)")
    ns = p.parse_args()

    import torch

    t_start = time.perf_counter()
    device = ns.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    if ns.vocab_size is None:
        ns.vocab_size = 151936 if cuda else 0
    temperature = ns.temperature if ns.temperature is not None else (0.6 if cuda else 0.0)
    sizes = ns.batch_sizes
    modes = [m for m in (ns.modes or (",".join(MODES) if cuda else "free-sync,json"))
             .split(",") if m]
    with tempfile.TemporaryDirectory(prefix="shoal-so-host-") as tmp:
        t0 = time.perf_counter()
        llm = build_llm(ns, device, max(sizes), Path(tmp))
        build_s = time.perf_counter() - t0
    core = engine_internals.core(llm, required=True)
    async_default = core.async_scheduling
    tok_vocab = len(core.structured._tokenizer)
    result: dict[str, Any] = {
        **provenance(), "workload": "structured-outputs-host-costs", "hardware": hardware(),
        "cpu": cpu_model(), "torch": torch.__version__, "device": device,
        "async_default": async_default,
        "vocab": core.vocab_size, "tokenizer_vocab": tok_vocab,
        "tokenizer": ns.tokenizer, "temperature": temperature,
        "torch_threads": torch.get_num_threads(),
        "engine_build_s": round(build_s, 2), "schema": SCHEMA, "runs": [],
    }
    try:
        import xgrammar

        result["xgrammar"] = getattr(xgrammar, "__version__", None) or \
            xgrammar._version.version  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - informational
        pass
    # Compile the grammar first (in the manager's pool), outside every timed step.
    from shoal.structured_output.params import StructuredOutputsParams

    core.structured.validate(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    for mode in modes:  # first calls of every path (kernels, allocator), not recorded
        time_mode(core, mode, min(8, max(sizes)), 4, async_default, temperature)
    for batch in sizes:
        steps = ns.steps or ((40 if batch <= 64 else 30) if cuda else
                             (30 if batch <= 64 else 10))
        for mode in modes:
            r = time_mode(core, mode, batch, steps, async_default, temperature)
            result["runs"].append(r)
            print(json.dumps({k: r[k] for k in ("mode", "batch", "clean_step_ms_median",
                                                "grammar_total_ms", "breakdown_ms")}),
                  flush=True)
    by = {(r["mode"], r["batch"]): r for r in result["runs"]}
    for base in ("free-sync", "free-async"):
        for stat in ("median", "min"):
            result[f"json_over_{base}_clean_{stat}"] = {
                str(b): round(by["json", b][f"clean_step_ms_{stat}"]
                              / by[base, b][f"clean_step_ms_{stat}"], 3)
                for b in sizes if ("json", b) in by and (base, b) in by}
    result["summary_ms"] = summary(result["runs"])
    if ns.profile_steps and "json" in modes:
        result["profile_json"] = profile_steps(core, max(sizes), ns.profile_steps,
                                               temperature)
    result["xgrammar_alone"] = []
    with torch.inference_mode():  # as in the engine: its bitmask buffer is made in one
        for v in (int(x) for x in ns.xgr_vocab_sizes.split(",") if x):
            result["xgrammar_alone"].append(
                xgrammar_pieces(core, sizes, max(v, tok_vocab), device, ns.repeats))
    result["seconds"] = round(time.perf_counter() - t_start, 1)
    llm.shutdown()
    out = write(result, ns.out)
    print(json.dumps({k: v for k, v in result.items() if k.startswith("json_over")}))
    for b, row in result["summary_ms"].items():
        print("batch", b, json.dumps(row))
    for x in result["xgrammar_alone"]:
        print(json.dumps({"vocab": x["vocab"], "special_token_ids": x["special_token_ids"],
                          "fill_per_row_us": {n: r["fill_per_row_us_default_threads"]
                                              for n, r in x["by_n"].items()}}))
    print("seconds", result["seconds"], "wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
