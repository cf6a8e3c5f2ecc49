"""Where a batch-1 decode step's GPU time goes, by kernel and by module kind, against the
weight-read floor of each part; written for GPT-OSS-20B (shoal/model_configs/gpt-oss-20b,
the default), and any shipped config folder works (e.g. llama-3.1-8b), on random weights
(load_format="dummy").

    python benchmarks/step_profile_gpu.py --out bench-work/stepprof.json
    python benchmarks/step_profile_gpu.py --model shoal/model_configs/llama-3.1-8b --out F
    python benchmarks/step_profile_gpu.py --smoke --out /tmp/stepprof.json   # CPU, tiny

Three sections, one record (every figure per decode step at batch 1, after a warm-up):

- eager: an enforce_eager engine; torch.profiler over one request (--context prompt ids,
  then --steps decode steps). Each kernel (its launch's CPU correlation in the trace) is
  charged to the innermost of the ranges this script opens: every runner step and its
  sampling, the model's forward, and around each module by kind: attention_linears (q/k/v/o
  projections), attention_kernel (paged attention, its rotary and cache write), rotary,
  experts (FusedMoE), router, mlp_linears / activation (a dense MLP), dense_linears
  (others), norms, embedding, lm_head (compute_logits), sampling; what runs in the model's
  forward outside them is other_model (residual adds, ...), in the runner's step other_step
  (inputs). Kernels by name: the top --top by time a step, with calls a step and us a call.
- graph: a CUDA-graph engine of the same model: the decode graph's replay time (ms, wall
  over --replays replays), and torch.profiler over those replays: the kernels a replay
  runs, their summed time, and the share of the replay the GPU spends in kernels (the rest
  is the gaps between them), with the top kernels by name.
- floor: the bytes a token reads by part (gpt_oss_gpu.active_bytes for gpt-oss; for a dense
  model attention, mlp, norms, an embedding row and the LM head) over the card's copy
  bandwidth (offline_runs.copy_bandwidth), beside the eager kernel time of the kinds that
  read them. KV reads are not in the floor.

Also the launch tuner's choices (shoal/layers/quantization/launch_tuner.py: which MXFP4
expert path, FP8/INT4 GEMV tiles), where engine internals are reachable.

--smoke: gpt_oss_gpu's tiny gpt-oss config on the CPU in float32 (dense experts), the eager
section only, CPU ops in place of kernels: it checks the script, not the speed."""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import engine_internals
import offline_runs
from bench_args import REQUIRED, add_common
from gpt_oss_gpu import SMOKE_CONFIG, active_bytes
from results_file import record, shoal_source, write
from trace_charges import (
    MODEL,
    PREFIX,
    SAMPLE,
    STEP,
    StepFigures,
    charges,
    decode_figures,
    per_step,
    step_of,
)

DEFAULT_MODEL = "gpt-oss-20b"  # a folder under shoal/model_configs
# the floor's parts, by the kinds whose kernels read their bytes
FLOOR_KINDS = {"attention": ("attention_linears",), "mlp": ("mlp_linears", "activation"),
               "active_experts": ("experts",), "router": ("router",), "norms": ("norms",),
               "embedding_row": ("embedding",), "lm_head": ("lm_head",)}


# ---- module kinds and the ranges around them --------------------------------------------------

def module_kind(name: str, module: Any) -> str | None:
    """The kind a module's kernels are charged to (None: not a range of its own)."""
    cls = type(module).__name__
    last = name.rsplit(".", 1)[-1]
    if cls == "FusedMoE":
        return "experts"
    if cls.endswith("Router") or last in ("router", "gate"):
        return "router"
    if cls in ("Attention", "LatentAttention") or cls.endswith("AttentionBackendModule"):
        return "attention_kernel"
    if "Rotary" in cls or "RoPE" in cls:
        return "rotary"
    if "Norm" in cls:
        return "norms"
    if cls.endswith("Linear"):
        if "attn" in name:
            return "attention_linears"
        return "mlp_linears" if ".mlp." in f"{name}." else "dense_linears"
    if cls.endswith("Embedding") and last != "lm_head":
        return "embedding"
    if "SiluAndMul" in cls or cls.endswith("Activation") or last == "act_fn":
        return "activation"
    return None


class Ranges:
    """Profiler ranges (record_function) around the modules of one model, its forward and
    compute_logits, and the runner's execute / sample; undo() takes them all away."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        self._open: list[Any] = []
        self._steps = itertools.count()
        self._handles: dict[int, tuple[int, int]] = {}

    def hook_modules(self, model: Any) -> int:
        """A range around each module of a kind (module_kind), and MODEL around the
        decoder stack (the `model` submodule, else the whole model); compute_logits in
        lm_head's. Returns the ranged modules."""
        count = 0
        stack = getattr(model, "model", None)
        for name, module in model.named_modules():
            kind = module_kind(name, module)
            if module is (stack if stack is not None else model):
                kind = MODEL
            if kind is not None:
                self._hook(module, PREFIX + kind)
                count += 1
        self.wrap(model, "compute_logits", lambda *a, **k: PREFIX + "lm_head")
        return count

    def _hook(self, module: Any, label: str) -> None:
        from torch.autograd.profiler import record_function

        def enter(_m: Any, _args: Any) -> None:
            r = record_function(label)
            r.__enter__()
            self._open.append(r)

        def leave(_m: Any, _args: Any, _out: Any) -> None:
            if self._open:
                self._open.pop().__exit__(None, None, None)

        handles = (module.register_forward_pre_hook(enter), module.register_forward_hook(leave))
        self._undo.append(lambda: [h.remove() for h in handles])

    def hook_runner(self, runner: Any) -> None:
        """execute(sched) opens "step <i> t=<tokens>"; sample(handle, ...) opens the same
        step's "sample <i> t=<tokens>" (matched by the handle execute returned)."""
        from torch.autograd.profiler import record_function

        execute, sample = runner.execute, runner.sample

        def step(sched: Any) -> Any:
            i, t = next(self._steps), int(getattr(sched, "num_scheduled_tokens", 0) or 0)
            with record_function(f"{PREFIX}{STEP} {i} t={t}"):
                handle = execute(sched)
            self._handles[id(handle)] = (i, t)
            return handle

        def sampled(handle: Any, *args: Any, **kw: Any) -> Any:
            i, t = self._handles.pop(id(handle), (-1, 0))
            with record_function(f"{PREFIX}{SAMPLE} {i} t={t}"):
                return sample(handle, *args, **kw)

        self._replace(runner, "execute", step)
        self._replace(runner, "sample", sampled)

    def wrap(self, obj: Any, attr: str, label: Callable[..., str]) -> None:
        from torch.autograd.profiler import record_function

        if not hasattr(obj, attr):
            return
        orig = getattr(obj, attr)

        def ranged(*args: Any, **kw: Any) -> Any:
            with record_function(label(*args, **kw)):
                return orig(*args, **kw)

        self._replace(obj, attr, ranged)

    def _replace(self, obj: Any, attr: str, fn: Callable[..., Any]) -> None:
        """obj.attr = fn until undo(), which puts back an instance attribute that was
        there, else removes fn (the class's method again)."""
        own = vars(obj).get(attr)
        setattr(obj, attr, fn)
        self._undo.append(lambda: setattr(obj, attr, own) if own is not None
                          else delattr(obj, attr))

    def undo(self) -> None:
        for fn in reversed(self._undo):
            fn()
        self._undo.clear()


# ---- the floor --------------------------------------------------------------------------------

def dense_active_bytes(cfg: dict[str, Any], dense_bytes: int) -> dict[str, Any] | None:
    """A dense decoder's bytes a batch-1 token reads by part (None: a MoE config)."""
    if any(k in cfg for k in ("num_local_experts", "num_experts", "n_routed_experts")):
        return None
    h, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads, kv = int(cfg["num_attention_heads"]), int(cfg.get("num_key_value_heads") or
                                                      cfg["num_attention_heads"])
    hd = int(cfg.get("head_dim") or h // heads)
    inter = int(cfg["intermediate_size"])
    q, kvd = heads * hd, kv * hd
    parts = dict(attention=layers * (h * (q + 2 * kvd) + q * h) * dense_bytes,
                 mlp=layers * 3 * h * inter * dense_bytes,
                 norms=(2 * layers + 1) * h * dense_bytes, embedding_row=h * dense_bytes,
                 lm_head=int(cfg["vocab_size"]) * h * dense_bytes)
    return dict(bytes_per_token=sum(parts.values()), bytes_by_part=parts)


def floor_table(cfg: dict[str, Any], dense_bytes: int, bandwidth: float,
                eager: StepFigures | None) -> dict[str, Any]:
    if cfg.get("model_type") == "gpt_oss":
        b = active_bytes(cfg, dense_bytes)
        rule = "gpt_oss_gpu.active_bytes (MXFP4 experts, the rest in the model dtype)"
    else:
        b = dense_active_bytes(cfg, dense_bytes)
        rule = "dense decoder: q/k/v/o, gate/up/down, norms, one embedding row, LM head"
    if b is None:
        return dict(floor_rule="no floor rule for this MoE config", parts=[])
    parts = []
    for part, nbytes in b["bytes_by_part"].items():
        kinds = FLOOR_KINDS.get(part, ())
        measured = sum(eager.by_kind.get(k, {}).get("us", 0.0) for k in kinds) if eager \
            else None
        floor_us = nbytes / bandwidth * 1e6
        parts.append(dict(part=part, kinds=list(kinds), bytes=nbytes, floor_us=floor_us,
                          eager_kernel_us=measured,
                          floor_over_measured=floor_us / measured if measured else None))
    total = b["bytes_per_token"] / bandwidth * 1e6
    return dict(floor_rule=rule, copy_bandwidth=bandwidth, bytes_per_token=b["bytes_per_token"],
                floor_us=total, floor_tok_s=1e6 / total, parts=parts)


# ---- the runs ---------------------------------------------------------------------------------

def _engine(folder: Path, smoke: bool, eager: bool, max_model_len: int) -> offline_runs.Engine:
    kw: dict[str, Any] = dict(load_format="dummy", dtype="float32" if smoke else "bfloat16",
                              max_model_len=max_model_len, max_num_seqs=8,
                              kv_cache_memory_bytes=(32 << 20) if smoke else 4 << 30,
                              enforce_eager=eager)
    if smoke:
        kw["device"] = "cpu"
    return offline_runs.start_engine(str(folder), **kw)


def _prompt(vocab: int, n: int, seed: int) -> dict[str, list[int]]:
    import random

    return offline_runs.random_prompt(random.Random(seed), n, min(vocab, 10000), 3)


def _trace(fn: Callable[[], Any], cuda: bool) -> dict[str, Any]:
    """fn() under torch.profiler; its Chrome trace as a dict."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with tempfile.TemporaryDirectory(prefix="stepprof-") as tmp:
        with profile(activities=acts) as prof:
            fn()
            if cuda:
                torch.cuda.synchronize()
        path = Path(tmp, "trace.json")
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def eager_section(args: argparse.Namespace, folder: Path, cfg: dict[str, Any]
                  ) -> tuple[dict[str, Any], StepFigures | None]:
    import torch

    from shoal import SamplingParams

    eng = _engine(folder, args.smoke, True, args.max_model_len)
    llm, vocab = eng.llm, int(cfg["vocab_size"])
    runner = engine_internals.runner(llm)
    if runner is None:
        raise RuntimeError("the eager profile needs the engine's runner (engine internals)")
    params = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
    llm.generate(_prompt(vocab, args.context, 1), params, use_tqdm=False)  # warm-up, tuning
    ranges = Ranges()
    hooked = ranges.hook_modules(runner.model)
    ranges.hook_runner(runner)
    t0 = time.perf_counter()
    try:
        trace = _trace(lambda: llm.generate(_prompt(vocab, args.context, 2), params,
                                            use_tqdm=False), torch.cuda.is_available())
    finally:
        ranges.undo()
    wall = time.perf_counter() - t0
    got = charges(trace)
    fig = decode_figures(got, 1, args.top)
    steps = [s for s in (step_of(c.ranges) for c in got) if s is not None]
    out = dict(ready_s=eng.ready_s, modules_ranged=hooked, profiled_wall_s=wall,
               steps_seen=sorted({s for s in steps}), decode_steps=fig.steps,
               device_us_per_step=fig.us_per_step, kernels_per_step=fig.kernels_per_step,
               by_kind=fig.by_kind, top_kernels=fig.by_kernel,
               tuner=_tuner_choices())
    llm.shutdown()
    return out, fig


def _decode_graph(llm: Any, batch: int) -> Any | None:
    """The captured decode graph of `batch` rows (engine_internals.graph_replay_ms's
    look-up)."""
    graphs = getattr(engine_internals.runner(llm), "graphs", None)
    table = getattr(getattr(graphs, "table", None), "graphs", None)
    key: Any = next((s for s in table or () if s.rows == batch and s.q == 1), None)
    if table is None:
        table, key = getattr(graphs, "graphs", None), batch
    return table[key] if table and key in table else None


def graph_section(args: argparse.Namespace, folder: Path, cfg: dict[str, Any]
                  ) -> dict[str, Any]:

    from shoal import SamplingParams

    eng = _engine(folder, args.smoke, False, args.max_model_len)
    llm = eng.llm
    params = SamplingParams(temperature=0, max_tokens=args.steps + 1, ignore_eos=True)
    llm.generate(_prompt(int(cfg["vocab_size"]), args.context, 3), params, use_tqdm=False)
    replay_ms = engine_internals.graph_replay_ms(llm, 1, args.replays)
    g = _decode_graph(llm, 1)
    out: dict[str, Any] = dict(ready_s=eng.ready_s, graph_replay_ms=replay_ms,
                               replays=args.replays, tuner=_tuner_choices())
    if g is not None:
        trace = _trace(lambda: [g.replay() for _ in range(args.replays)], True)
        kernels = [c for c in charges(trace)]
        fig = per_step(kernels, args.replays, args.top, by_kind=False)
        out |= dict(kernels_per_replay=fig.kernels_per_step,
                    kernel_us_per_replay=fig.us_per_step,
                    kernel_busy_share=(fig.us_per_step / (replay_ms * 1000)
                                       if replay_ms else None),
                    gap_us_per_kernel=((replay_ms * 1000 - fig.us_per_step)
                                       / fig.kernels_per_step
                                       if replay_ms and fig.kernels_per_step else None),
                    top_kernels=fig.by_kernel)
    else:
        out["note"] = "no decode graph of batch 1 found (engine internals)"
    llm.shutdown()
    return out


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _tuner_choices() -> list[dict[str, Any]] | None:
    """launch_tuner's timed keys: the choice and each candidate's us (None: not importable)."""
    try:
        from shoal.layers.quantization.launch_tuner import TUNED
    except ImportError:
        return None
    return [dict(key=[str(k) for k in key] if isinstance(key, tuple) else str(key),
                 choice=t.choice, times_us=t.times_us) for key, t in TUNED.items()]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common(ap, out=REQUIRED, smoke="CPU, float32, gpt_oss_gpu's tiny gpt-oss config")
    ap.add_argument("--model", default=None,
                    help=f"a config folder (default shoal/model_configs/{DEFAULT_MODEL})")
    ap.add_argument("--steps", type=int, default=8, help="decode steps profiled (default 8)")
    ap.add_argument("--context", type=int, default=128, help="prompt ids (default 128)")
    ap.add_argument("--replays", type=int, default=20, help="graph replays (default 20)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed (default 25)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--sections", default="eager,graph", help="eager, graph or both")
    args = ap.parse_args(argv)
    for name in ("steps", "context", "replays", "top"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1")
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    if not sections or sections - {"eager", "graph"}:
        ap.error(f"--sections: eager, graph or both, got {args.sections!r}")
    if engine_internals.public_only():
        ap.error("the profile needs engine internals: unset SHOAL_BENCH_PUBLIC_ONLY")
    tmp = None
    if args.model is not None:
        folder = Path(args.model)
    elif args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="stepprof-smoke-")
        folder = Path(tmp.name)
        (folder / "config.json").write_text(json.dumps(SMOKE_CONFIG))
        args.max_model_len = min(args.max_model_len, 256)
        args.context = min(args.context, 16)
    else:
        folder = Path(shoal_source() or ".", "shoal", "model_configs", DEFAULT_MODEL)
    cfg = json.loads((folder / "config.json").read_text())
    rec: dict[str, Any] = dict(model=str(folder), model_type=cfg.get("model_type"),
                               smoke=args.smoke, batch=1, context=args.context,
                               decode_steps=args.steps)
    eager = None
    try:
        if "eager" in sections:
            rec["eager"], eager = eager_section(args, folder, cfg)
            _free()  # the eager engine's weights and cache, before the next one
        if "graph" in sections and not args.smoke:
            rec["graph"] = graph_section(args, folder, cfg)
    except Exception as e:  # what ran so far is kept
        import traceback

        traceback.print_exc()
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["floor"] = floor_table(cfg, 4 if args.smoke else 2, offline_runs.copy_bandwidth(),
                               eager)
    out = record("step_profile", "shoal", **rec)
    write(out, args.out)
    _summary(out)
    if tmp is not None:
        tmp.cleanup()
    return out


def _summary(rec: dict[str, Any]) -> None:
    e, g, f = rec.get("eager") or {}, rec.get("graph") or {}, rec.get("floor") or {}
    if e:
        print(f"eager: {e['device_us_per_step']:.0f} us of device time a decode step, "
              f"{e['kernels_per_step']:.0f} kernels")
        for kind, v in e["by_kind"].items():
            print(f"  {kind:18s} {v['us']:9.1f} us  {v['kernels']:6.1f} kernels")
    if g:
        print(f"graph: replay {g.get('graph_replay_ms')} ms, "
              f"{g.get('kernels_per_replay')} kernels, {g.get('kernel_us_per_replay')} us")
    for p in f.get("parts", []):
        print(f"  floor {p['part']:15s} {p['floor_us']:8.1f} us  eager {p['eager_kernel_us']}")


if __name__ == "__main__":
    sys.exit(1 if "error" in main() else 0)

