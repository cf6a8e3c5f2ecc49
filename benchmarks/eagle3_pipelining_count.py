"""Issue 38: where an EAGLE-3 drafter's cost at forced acceptance 0 comes from, counted (not
timed) in W9's run shape: 128 input / 256 output tokens, greedy, k = 4, async scheduling, the
forced acceptance rate 0 (every draft rejected), for `forced` (no drafter), `eagle3` and
`eagle3_confidence` (benchmarks/spec_methods.py), at each batch size. Per run:

    steps        launched steps: pipelined (launched while another step ran), verify steps,
                 and the launches that were not pipelined, by why: start (the run's first),
                 verify (its drafts come from the step before, run alone), after_verify (the
                 step after a verify step), else why the loop ran the step before alone:
                 wants_drafts (the scheduler's wants_drafts said some request would verify
                 next, and none did), history, nothing_to_schedule
    proposals    drafting calls that produced drafts, and their fate at the request's next
                 step: verified, or not and why (backing_off, budget, confidence, ...);
                 critical: made while no later step was in flight (the device idles until the
                 next launch, so their host time and device time are the step's gap)
    mirror       the drafter's mirror calls: passes run (eager on the CPU; graph_passes:
                 one mirror-graph replay, CUDA), catch-ups (a backlog of paused rows
                 mirrored; and those on the critical path), passes on the critical path,
                 passes none of whose requests verify at their next step; torch calls
                 (Python-issued) on and off the critical path
    backoff      per request: its verify steps and the lengths of its pauses, in order
    host_ms      CPU seconds of on_launch and mirror_and_propose, on and off the critical path
                 (this machine's: indicative only; a GPU's host pays ~5-10 us a torch call)

    python benchmarks/eagle3_pipelining_count.py --smoke --out /tmp/e3count.json   # CPU, tiny
    python benchmarks/eagle3_pipelining_count.py --out /tmp/e3count.json           # 8B, GPU

Each engine runs in a process of its own (two 8B engines do not fit one GPU). Counts come
from wrappers put on engine internals (engine_internals.core), so the figures describe this
tree's loop; `tokens_match_plain` checks the run against plain decoding (at
rate 0 the forced rule keeps every target token, so the output is the target's greedy; on a
GPU in bf16 a verify step's rows may round otherwise than a decode step's, so a mismatch there
is not by itself a bug)."""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import engine_internals
import offline_runs
import spec_methods
from bench_args import REQUIRED, add_common, comma_ints, comma_words
from offline_runs import LLAMA_8B


class TorchCalls:
    """Counts Python-issued torch calls (attribute reads left out) while active."""

    _FREE = {"__get__", "shape", "dtype", "device", "size", "dim", "numel", "data_ptr",
             "stride", "is_contiguous", "__len__", "ndim", "is_cuda"}

    def __init__(self) -> None:
        from torch.overrides import TorchFunctionMode

        counter = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (),
                                   kwargs: Any = None) -> Any:
                if getattr(func, "__name__", "") not in TorchCalls._FREE:
                    counter.calls += 1
                return func(*args, **(kwargs or {}))

        self.calls = 0
        self.mode = Mode

    def count(self, fn: Any, *args: Any, **kw: Any) -> tuple[Any, int, float]:
        """fn's result, its torch calls and host seconds."""
        before = self.calls
        t0 = time.perf_counter()
        with self.mode():
            result = fn(*args, **kw)
        return result, self.calls - before, time.perf_counter() - t0


class LoopCounts:
    """Wrappers on one engine's core, runner, draft budget and drafter; figures() reads."""

    def __init__(self, llm: Any):
        self.core = core = engine_internals.core(llm, required=True)
        self.runner, self.budget = core.runner, core.scheduler.drafts
        self.drafter = getattr(self.runner, "drafter", None)
        self.torch = TorchCalls()
        self.step = 0  # launched steps so far
        self.launches: list[dict[str, Any]] = []
        self.serialized: str | None = None  # why the last _run_step left nothing in flight
        self.why: dict[int, str] = {}  # serial -> why its drafts are not verified this step
        self.proposals: dict[int, tuple[int, bool]] = {}  # serial -> (step, critical)
        self.fates: Counter[str] = Counter()
        self.critical_fates: Counter[str] = Counter()
        self.mirrors: Counter[str] = Counter()
        self.ops: Counter[str] = Counter()
        self.host: dict[str, float] = defaultdict(float)
        self.mirrored: list[set[int]] = []  # serials of passes awaiting their next step
        self.verifies: dict[int, int] = Counter()
        self.pauses: dict[int, list[int]] = defaultdict(list)
        self._undo: list[Any] = []
        self._wrap()

    # ---- wrappers ----------------------------------------------------------------------------
    def _set(self, obj: Any, attr: str, fn: Any) -> None:
        own = vars(obj).get(attr)
        setattr(obj, attr, fn)
        self._undo.append(lambda: setattr(obj, attr, own) if own is not None
                          else delattr(obj, attr))

    def restore(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _wrap(self) -> None:
        core, budget = self.core, self.budget
        run_step, execute, num_drafts = core._run_step, self.runner.execute, budget.num_drafts
        back_off = budget._back_off

        def counted_run_step() -> Any:
            reason = self._depth_reason()
            out = run_step()
            if not core.queue:  # the step launched (or in flight) ran alone
                self.serialized = reason
            return out

        def counted_execute(sched: Any) -> Any:
            if not sched.is_empty:
                self._launched(sched)
            return execute(sched)

        def counted_num_drafts(req: Any, room: int, allowed: bool, running: int) -> int:
            paused, had = req.spec_skip > 0, bool(req.spec_token_ids)
            misses = req.spec_misses
            n = num_drafts(req, room, allowed, running)
            self.why[req.serial] = (
                "verified" if n else "backing_off" if paused else
                "not_allowed" if not allowed else "no_drafts" if not had else
                "pending" if req.num_pending_tokens else
                "confidence" if req.spec_misses > misses else "budget")
            return n

        def counted_back_off(req: Any) -> None:
            skip = req.spec_skip
            back_off(req)
            if req.spec_skip != skip:
                self.pauses[req.serial].append(req.spec_skip)

        self._set(core, "_run_step", counted_run_step)
        self._set(self.runner, "execute", counted_execute)
        self._set(budget, "num_drafts", counted_num_drafts)
        self._set(budget, "_back_off", counted_back_off)
        if self.drafter is not None and hasattr(self.drafter, "mirror_and_propose"):
            self._wrap_hidden_state_drafter(self.drafter)
        elif self.drafter is not None:
            self._wrap_host_drafter(self.drafter)

    def _wrap_hidden_state_drafter(self, drafter: Any) -> None:
        import shoal.spec_decode.mirror_backlog as backlog

        launch, mirror, run_depth, propose, graphed = (
            drafter.on_launch, drafter.mirror_and_propose, drafter._run_depth, drafter._propose,
            drafter._mirror_through_graph)
        take = backlog.take
        state = {"proposing": False, "passes": 0, "caught": 0, "graphed": 0}

        def counted_launch(step: Any) -> Any:
            out, ops, secs = self.torch.count(launch, step)
            self.ops["on_launch"] += ops
            self.host["on_launch"] += secs
            return out

        def counted_mirror(reqs: Any, hidden: Any, failed: Any, propose: bool = True) -> Any:
            critical = self._critical()
            state["passes"] = state["caught"] = state["graphed"] = 0
            drafts, ops, secs = self.torch.count(mirror, reqs, hidden, failed, propose=propose)
            where = "critical" if critical else "overlapped"
            self.ops[f"mirror_and_propose_{where}"] += ops
            self.host[f"mirror_and_propose_{where}"] += secs
            self.mirrors["calls"] += 1
            if state["passes"] or state["graphed"]:
                self.mirrors["passes"] += 1
                self.mirrors["graph_passes"] += state["graphed"]
                self.mirrors[f"passes_{where}"] += 1
                self.mirrors["catch_ups"] += state["caught"] > 0
                self.mirrors["catch_ups_critical"] += state["caught"] > 0 and critical
                self.mirrored.append({r.serial for r in reqs if not r.paused})
            self._proposed(drafts, critical)
            return drafts

        def counted_run_depth(*args: Any) -> Any:
            if not state["proposing"]:
                state["passes"] += 1
            return run_depth(*args)

        def counted_graphed(*args: Any) -> Any:  # (CUDA: the mirror graphs' replay)
            state["graphed"] += 1
            return graphed(*args)

        def counted_propose(*args: Any, **kw: Any) -> Any:
            state["proposing"] = True
            try:
                return propose(*args, **kw)
            finally:
                state["proposing"] = False

        def counted_take(st: Any, context_len: int) -> Any:
            got = take(st, context_len)
            if got is not None:
                state["caught"] += 1
                self.mirrors["catch_up_rows"] += len(got.kept)
            return got

        self._set(drafter, "on_launch", counted_launch)
        self._set(drafter, "mirror_and_propose", counted_mirror)
        self._set(drafter, "_run_depth", counted_run_depth)
        self._set(drafter, "_propose", counted_propose)
        self._set(drafter, "_mirror_through_graph", counted_graphed)
        backlog.take = counted_take
        self._undo.append(lambda: setattr(backlog, "take", take))

    def _wrap_host_drafter(self, drafter: Any) -> None:
        propose = drafter.propose

        def counted_propose(step: Any, state: Any, out: Any, latest: bool) -> None:
            critical = self._critical()
            before = set(out.draft_token_ids)
            propose(step, state, out, latest)
            self._proposed({s: out.draft_token_ids[s] for s in out.draft_token_ids
                            if s not in before}, critical)

        self._set(drafter, "propose", counted_propose)

    # ---- bookkeeping -------------------------------------------------------------------------
    def _critical(self) -> bool:
        """A finish with no later step in flight: the device waits for the next launch."""
        return len(self.core.queue) <= 1

    def _depth_reason(self) -> str:
        core = self.core
        if core._history_requests:
            return "history"
        if any(s.sched.has_drafts for s in core.queue):
            return "behind_verify"
        if core._speculating and core.scheduler.wants_drafts(core._proposals_known):
            return "wants_drafts"
        return "nothing_to_schedule"

    def _proposed(self, drafts: dict[int, list[int]], critical: bool) -> None:
        for serial, d in drafts.items():
            if d:
                self.proposals[serial] = (self.step, critical)

    def _launched(self, sched: Any) -> None:
        pipelined = len(self.core.queue) > 1  # (the step itself is in the queue already)
        why = None
        if not pipelined:
            why = ("start" if not self.launches else "verify" if sched.has_drafts else
                   "after_verify" if self.launches[-1]["verify"] else
                   self.serialized or "unknown")
        self.launches.append({"pipelined": pipelined, "verify": sched.has_drafts, "why": why})
        self.serialized = None
        self.step += 1
        scheduled = {it.serial: it for it in sched.scheduled}
        for serial, it in scheduled.items():
            if it.num_draft_tokens:
                self.verifies[serial] += 1
            made = self.proposals.pop(serial, None)
            if made is not None:
                fate = self.why.get(serial, "verified" if it.num_draft_tokens else "unknown")
                self.fates[fate] += 1
                if made[1]:
                    self.critical_fates[fate] += 1
        for serials in self.mirrored:  # passes whose requests' next step is this one
            if serials and not any(scheduled[s].num_draft_tokens for s in serials
                                   if s in scheduled):
                self.mirrors["passes_none_verify_next"] += 1
        self.mirrored = []
        self.why = {}

    def figures(self) -> dict[str, Any]:
        launches = self.launches
        not_pipelined = Counter(x["why"] for x in launches if not x["pipelined"])
        out: dict[str, Any] = {
            "steps": {"launched": len(launches),
                      "pipelined": sum(x["pipelined"] for x in launches),
                      "not_pipelined": sum(not x["pipelined"] for x in launches),
                      "verify": sum(x["verify"] for x in launches),
                      "not_pipelined_why": dict(not_pipelined)},
            "proposals": {"made": sum(self.fates.values()) + len(self.proposals),
                          "critical": sum(self.critical_fates.values()),
                          "fate": dict(self.fates), "critical_fate": dict(self.critical_fates),
                          "unresolved": len(self.proposals)},
        }
        if self.drafter is not None and hasattr(self.drafter, "mirror_and_propose"):
            out["mirror"] = dict(self.mirrors)
            out["torch_calls"] = dict(self.ops)
            out["host_ms"] = {k: round(v * 1e3, 2) for k, v in self.host.items()}
        verifies = sorted(self.verifies.values())
        pauses = list(self.pauses.values())
        out["backoff"] = {
            "verify_steps_per_request": {"min": verifies[0] if verifies else 0,
                                         "max": verifies[-1] if verifies else 0},
            "pauses_of_first_request": pauses[0] if pauses else [],
            "pause_sequences": len({tuple(p) for p in pauses}),
        }
        return out


def count_run(llm: Any, prompts: list[dict], sp: Any) -> tuple[dict[str, Any], list]:
    counts = LoopCounts(llm)
    try:
        outs = llm.generate(prompts, sp, use_tqdm=False)
    finally:
        counts.restore()
    return counts.figures(), [list(o.outputs[0].token_ids) for o in outs]


def engine_part(args: argparse.Namespace, method: str | None) -> dict[str, Any]:
    """One engine (plain: method None): each batch size's counts and output tokens."""
    from shoal import SamplingParams

    kw = spec_methods.engine_kwargs(args, method, args.confidence_threshold)
    eng = offline_runs.start_engine(args.model, async_scheduling=True, **kw)
    vocab = engine_internals.vocab_size(eng.llm) or 32000
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    out: dict[str, Any] = {}
    for batch in args.batch_sizes:
        prompts = [offline_runs.random_prompt(random.Random(batch * 1000 + i), args.input_len,
                                              vocab, lo=100) for i in range(batch)]
        if method is None:
            tokens = [list(o.outputs[0].token_ids)
                      for o in eng.llm.generate(prompts, sp, use_tqdm=False)]
            out[str(batch)] = {"tokens": tokens}
        else:
            fig, tokens = count_run(eng.llm, prompts, sp)
            out[str(batch)] = {"figures": fig, "tokens": tokens}
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common(p, out=REQUIRED, model=LLAMA_8B, load_format="dummy", dtype="bfloat16",
               device=None, smoke="the 2-layer Llama on the CPU (float32), W9's lengths")
    p.add_argument("--batch-sizes", type=comma_ints, default=[1, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--methods", type=comma_words, default=list(spec_methods.METHODS))
    p.add_argument("--confidence-threshold", type=float, default=0.5)
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)  # a subprocess's engine
    args = p.parse_args(argv)
    args.rates = [0.0]
    bad = [m for m in args.methods if m not in spec_methods.METHODS]
    if bad:
        raise ValueError(f"--methods: unknown {bad} (choose from {spec_methods.METHODS})")
    if args.smoke:
        args.dtype, args.device = "float32", args.device or "cpu"
        if args.model == LLAMA_8B:
            args.model = offline_runs.tiny_llama(Path(tempfile.mkdtemp(prefix="e3count-")))
    if args.part is not None:
        Path(args.out).write_text(json.dumps(
            engine_part(args, None if args.part == "plain" else args.part)))
        return 0
    # Each engine in its own process: two 8B engines do not fit one GPU's memory budget.
    parts: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for part in ["plain", *args.methods]:
            part_out = Path(tmp) / f"{part}.json"
            subprocess.run([sys.executable, __file__, *argv, "--model", args.model,
                            "--part", part, "--out", str(part_out)], check=True)
            parts[part] = json.loads(part_out.read_text())
    result: dict[str, Any] = {}
    for method in args.methods:
        for batch, got in parts[method].items():
            fig = got["figures"]
            fig["tokens_match_plain"] = got["tokens"] == parts["plain"][batch]["tokens"]
            result.setdefault(method, {})[batch] = fig
            print(f"{method} batch {batch}: {json.dumps(fig)}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
