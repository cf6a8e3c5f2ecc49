"""What the staged GPU scripts share (hybrid_gpu.py, deepseek_v4_gpu.py): their command line,
the records file every part appends to, one engine per stage built on first use, and each
stage run in a child process of its own.

A script names its parts and its stages ((stage, its parts) pairs); `main` parses with
`staged_parser` + `parse_staged`, then `run_stages` runs each stage either here
(--no-isolate) or through `run_child`, which re-runs the script with the hidden --stage flag.
A child's GPU memory comes back when it exits; a child that dies or outlasts --stage-timeout
leaves an error record (with its stderr tail) for every record it did not write."""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import offline_runs
from bench_args import REQUIRED, add_common, comma_ints, comma_words
from results_file import record, write

Stages = Sequence[tuple[str, Sequence[str]]]

# ---- the command line ----------------------------------------------------------------------


def staged_parser(description: str, parts: Sequence[str], stages: Stages, *, smoke: str,
                  enforce_eager: str, stage_timeout: float) -> argparse.ArgumentParser:
    """The flags every staged script takes; the script adds its own (its model flag)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("part", type=comma_words, help=f"all, or a comma list of {', '.join(parts)}")
    add_common(ap, out=REQUIRED, num_requests=None, max_num_seqs=256, seed=0, smoke=smoke)
    ap.add_argument("--contexts", type=comma_ints, default=None,
                    help="long_context lengths (default 1024,32768,131072)")
    ap.add_argument("--decode-tokens", type=int, default=None,
                    help="long_context: tokens decoded after the prefill (default 32)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="engine max_model_len (default: largest context + decode + 128)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None,
                    help="engine chunk of a step (default 8192)")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="engine and transformers dtype (default bfloat16; float32: the "
                    "correctness part's tight check, logprobs to ~1e-4)")
    ap.add_argument("--enforce-eager", action="store_true", help=enforce_eager)
    ap.add_argument("--no-isolate", action="store_true",
                    help="run every stage in this process (engines are not freed)")
    ap.add_argument("--stage-timeout", type=float, default=stage_timeout,
                    help="seconds a child process may take")
    ap.add_argument("--stage", choices=[s for s, _ in stages], help=argparse.SUPPRESS)
    return ap


def parse_staged(ap: argparse.ArgumentParser, argv: list[str] | None, parts: Sequence[str],
                 full: dict[str, Any], smoke: dict[str, Any]
                 ) -> tuple[argparse.Namespace, list[str], dict[str, Any]]:
    """The flags, the parts asked for (`all`: every part) and the sizes of this run (the full
    or the --smoke sizes, with the flags that override them)."""
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # transformers' hub kernels: never fetched
    wanted = list(parts) if args.part == ["all"] else args.part
    if unknown := [p for p in wanted if p not in parts]:
        ap.error(f"unknown part(s) {unknown}: all, or {', '.join(parts)}")
    sizes = dict(smoke if args.smoke else full)
    if args.dtype:
        sizes["dtype"] = args.dtype
    if args.decode_tokens:
        sizes["decode_tokens"] = args.decode_tokens
    if args.num_requests:
        sizes["num_requests"] = args.num_requests
    if args.smoke:
        args.max_num_seqs = min(args.max_num_seqs, 8)
    return args, wanted, sizes


def smoke_model(args: argparse.Namespace, config: dict[str, Any], name: str
                ) -> tempfile.TemporaryDirectory | None:
    """--smoke without --model: `config` written to a temporary folder `name`, which becomes
    args.model (the caller cleans the returned directory up); otherwise None."""
    if not args.smoke or args.model is not None:
        return None
    tmp = tempfile.TemporaryDirectory(prefix=f"{name}-")
    folder = Path(tmp.name, name)
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    args.model = str(folder)
    return tmp


# ---- the records file ----------------------------------------------------------------------

def read_records(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return []
    return data if isinstance(data, list) else []


def append(rec: dict[str, Any], path: Path) -> None:
    """Rewrites the file with one more record, so a run that dies keeps those before."""
    write(read_records(path) + [rec], path)


def error_record(workload: str, model: str, e: BaseException) -> dict[str, Any]:
    traceback.print_exc()
    return record(workload, "shoal", model=model, error=f"{type(e).__name__}: {e}",
                  traceback=traceback.format_exc()[-3000:])


# ---- engines -------------------------------------------------------------------------------

def free_memory() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def engine_kw(args: argparse.Namespace, sizes: dict[str, Any], max_model_len: int
              ) -> dict[str, Any]:
    """A stage engine's arguments: random weights of the shape; the KV budget and device only
    where the sizes name them (else the engine sizes its pool from free memory)."""
    kw: dict[str, Any] = dict(load_format="dummy", dtype=sizes["dtype"],
                              max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                              max_num_batched_tokens=args.max_num_batched_tokens
                              or sizes["max_num_batched_tokens"],
                              enforce_eager=args.enforce_eager)
    if sizes["kv_cache_memory_bytes"] is not None:
        kw["kv_cache_memory_bytes"] = sizes["kv_cache_memory_bytes"]
    if sizes.get("device"):
        kw["device"] = sizes["device"]
    return kw


class LazyEngine:
    """One engine, built on first use of `llm`; after a failed build every later use fails
    fast with the first error (a stage's later parts do not build it again)."""

    def __init__(self, folder: str, kw: dict[str, Any]):
        self.folder, self.kw = folder, kw
        self._engine: offline_runs.Engine | None = None
        self.build_error: str | None = None

    @property
    def llm(self) -> Any:
        if self._engine is None:
            if self.build_error is not None:
                raise RuntimeError(f"engine did not start: {self.build_error}")
            try:
                self._engine = offline_runs.start_engine(self.folder, **self.kw)
            except Exception as e:
                self.build_error = f"{type(e).__name__}: {e}"
                raise
        return self._engine.llm

    def ready_fields(self) -> dict[str, Any]:
        eng = self._engine
        return dict(ready_s=eng.ready_s if eng else None,
                    process_ready_s=eng.process_ready_s if eng else None)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.llm.shutdown()
            self._engine = None
            free_memory()


# ---- stages --------------------------------------------------------------------------------

def run_part(out: Path, workload: str, model: str, fn: Callable[..., dict[str, Any]],
             *a: Any) -> None:
    """One part's record (or its error record) appended to `out`, with its wall time."""
    t0 = time.perf_counter()
    try:
        rec = fn(*a)
    except Exception as e:  # one part's failure must not hide the others
        rec = error_record(workload, model, e)
    rec["part_wall_s"] = time.perf_counter() - t0
    print(json.dumps(rec, default=str)[:4000], flush=True)
    append(rec, out)


def run_engine_parts(out: Path, model: str, make: Callable[[], Any],
                     parts: Iterable[tuple[str, Callable[[Any], dict[str, Any]]]]) -> None:
    """(workload, fn) parts on one stage object from `make` (closed at the end); when `make`
    fails, every part gets its error record."""
    parts = list(parts)
    try:
        st = make()
    except Exception as e:
        for workload, _ in parts:
            append(error_record(workload, model, e), out)
        return
    try:
        for workload, fn in parts:
            run_part(out, workload, model, fn, st)
    finally:
        st.close()


def run_stages(args: argparse.Namespace, stages: Stages, parts: list[str],
               in_process: Callable[[str, list[str]], None],
               in_child: Callable[[str, list[str]], None]) -> None:
    """Each stage holding a part asked for, in order: here under --no-isolate, else in a
    child process."""
    for stage, stage_parts in stages:
        todo = [p for p in stage_parts if p in parts]
        if todo:
            (in_process if args.no_isolate else in_child)(stage, todo)


# The flags a child gets again when set (the script's model flag comes in `extra`).
CHILD_FLAGS = (("--num-requests", "num_requests"), ("--max-num-seqs", "max_num_seqs"),
               ("--max-model-len", "max_model_len"), ("--decode-tokens", "decode_tokens"),
               ("--max-num-batched-tokens", "max_num_batched_tokens"), ("--seed", "seed"),
               ("--dtype", "dtype"))


def run_child(args: argparse.Namespace, script: str, stage: str, parts: list[str], *,
              workloads: list[str], model: str, extra: Sequence[str] = ()) -> None:
    """`script` (the caller's __file__) run for one stage in a child process; each of
    `workloads` the child did not write gets an error record with the child's stderr tail."""
    cmd = [sys.executable, str(Path(script).resolve()), ",".join(parts), *extra, "--out",
           str(args.out), "--stage", stage]
    for flag, attr in CHILD_FLAGS:
        if getattr(args, attr) is not None:
            cmd += [flag, str(getattr(args, attr))]
    if args.contexts:
        cmd += ["--contexts", ",".join(map(str, args.contexts))]
    cmd += ["--smoke"] * args.smoke + ["--enforce-eager"] * args.enforce_eager
    before = len(read_records(args.out))
    tail: collections.deque[str] = collections.deque(maxlen=60)
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)

    def pump() -> None:  # stderr to ours as it comes, its tail kept for the record
        for line in proc.stderr:  # type: ignore[union-attr]
            sys.stderr.write(line)
            tail.append(line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        status = f"exited with status {proc.wait(timeout=args.stage_timeout)}"
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        status = f"was killed after --stage-timeout {args.stage_timeout:g} s"
    reader.join(5)
    written = {r.get("workload") for r in read_records(args.out)[before:]}
    for workload in workloads:
        if workload not in written:
            append(record(workload, "shoal", model=model, stage=stage,
                          error=f"child process {status} without writing this record",
                          stderr_tail="".join(tail)[-3000:]), args.out)
