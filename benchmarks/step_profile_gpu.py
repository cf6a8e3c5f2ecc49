"""Where a batch-1 decode step's GPU time goes, by kernel and by module kind, against the
weight-read floor of each part; written for GPT-OSS-20B (shoal/model_configs/gpt-oss-20b,
the default), and any shipped config folder works (e.g. llama-3.1-8b, deepseek-v2-lite,
qwen3-30b-a3b), on random weights (load_format="dummy"). --model takes a folder, a folder
name under shoal/model_configs, or a shipped name as deepseek_gpu.py does
(deepseek-ai/DeepSeek-V2-Lite: offline_runs.shipped_folder).

    python benchmarks/step_profile_gpu.py --out bench-work/stepprof.json
    python benchmarks/step_profile_gpu.py --model shoal/model_configs/llama-3.1-8b --out F
    python benchmarks/step_profile_gpu.py --model shoal/model_configs/deepseek-v2-lite --out F
    python benchmarks/step_profile_gpu.py --model Qwen/Qwen3-30B-A3B --out F
    python benchmarks/step_profile_gpu.py --smoke --out /tmp/stepprof.json   # CPU, tiny
    python benchmarks/step_profile_gpu.py --smoke --smoke-model deepseek --out /tmp/sp.json

Three sections, one record (every figure per decode step at batch 1, after a warm-up):

- eager: an enforce_eager engine; torch.profiler over one request (--context prompt ids,
  then --steps decode steps). Each kernel (its launch's CPU correlation in the trace) is
  charged to the innermost of the ranges this script opens: every runner step and its
  sampling, the model's forward, and around each module by kind (module_kind):
  attention_linears (q/k/v/o, MLA's q / q_a / q_b, kv_a, o projections), attention_kernel
  (paged or latent attention, its rotary and cache write), attention_other (the rest of an
  MLA module: the W_UK / W_UV bmms that read kv_b_proj; norms inside attention), rotary,
  experts (FusedMoE), router (gates), shared_experts (a MoE block's shared-expert MLP, all
  of it), moe_other (the rest of a MoE block), mlp_linears / activation (a dense MLP),
  dense_linears (others), norms, embedding, lm_head (compute_logits), sampling; what runs
  in the model's forward outside them is other_model (residual adds, ...), in the runner's
  step other_step (inputs). Kernels by name: the top --top by time a step, with calls a step and us a call.
- graph: a CUDA-graph engine of the same model: the decode graph's replay time (ms, wall
  over --replays replays), and torch.profiler over those replays: the kernels a replay
  runs, their summed time, and the share of the replay the GPU spends in kernels (the rest
  is the gaps between them), with the top kernels by name.
- floor: the bytes a token reads by part (gpt_oss_gpu.active_bytes for gpt-oss; for a dense
  model attention, mlp, norms, an embedding row and the LM head; for other MoE models
  (DeepSeek V2/V3/Kimi-K2, Qwen3-MoE, Mixtral, ...) moe_active_bytes over the engine's own
  model parameters by name: attention, router, active_experts (top_k experts a MoE layer),
  shared_experts, mlp (dense first layers), norms, embedding_row, lm_head) over the card's
  copy bandwidth (offline_runs.copy_bandwidth), beside the eager kernel time of the kinds
  that read them (step_floors.FLOOR_KINDS). KV reads are not in the floor. A MoE floor also gives
  bytes_per_token_whole_embedding, deepseek_gpu.py's rule (the whole embedding table): for
  V2-Lite in bf16 4.91 GB a token with one row (1.64 ms at an H100's 3.0 TB/s), 5.33 GB
  with the table (1.78 ms; deepseek_gpu's 5.32 GB counts the float32 router gates at 2 B).

Also the launch tuner's choices (shoal/layers/quantization/launch_tuner.py: which MXFP4
expert path, FP8/INT4 GEMV tiles), where engine internals are reachable.

--smoke: a tiny config on the CPU in float32, the eager section only, CPU ops in place of
kernels: it checks the script, not the speed. --smoke-model picks gpt_oss_gpu's gpt-oss
config (dense experts; the default) or deepseek_gpu's DeepSeek-V2 one (MLA, a dense first
layer, routed + shared experts)."""

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
import quant_gpu
from bench_args import REQUIRED, add_common
from deepseek_gpu import SMOKE_CONFIG as DEEPSEEK_SMOKE_CONFIG
from gpt_oss_gpu import SMOKE_CONFIG as GPT_OSS_SMOKE_CONFIG
from results_file import record, shoal_source, write
from step_floors import IN_ATTENTION, floor_table, model_weights
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
# --smoke-model: the tiny configs of the GPU scripts (CPU, float32)
SMOKE_CONFIGS = {"gpt-oss": GPT_OSS_SMOKE_CONFIG, "deepseek": DEEPSEEK_SMOKE_CONFIG}


# ---- module kinds and the ranges around them --------------------------------------------------

def module_kind(name: str, module: Any) -> str | None:
    """The kind a module's kernels are charged to (None: not a range of its own).
    attention_other: what runs in an MLA module outside its projections, kernel and rotary
    (the absorbed W_UK / W_UV bmms that read kv_b_proj, cats, splits) and the norms inside
    attention (MLA's q_a / kv_a norms, Qwen3's q / k norms); shared_experts: the whole
    shared-expert MLP of a MoE block (its linears and activation, and Qwen2-MoE's
    shared_expert_gate), not mlp_linears; moe_other: what a MoE block runs outside its
    router, experts and shared experts (the routed + shared add, casts)."""
    cls = type(module).__name__
    last = name.rsplit(".", 1)[-1]
    if cls == "FusedMoE":
        return "experts"
    if "shared_expert" in name:
        return "shared_experts"
    if cls.endswith("Router") or last in ("router", "gate"):
        return "router"
    if cls.endswith(("MoE", "SparseBlock", "SparseMoeBlock")):
        return "moe_other"
    if cls in ("Attention", "LatentAttention") or cls.endswith("AttentionBackendModule"):
        return "attention_kernel"
    if cls.endswith("MLA"):
        return "attention_other"
    if "Rotary" in cls or "RoPE" in cls:
        return "rotary"
    if "Norm" in cls:
        return "attention_other" if IN_ATTENTION.search(name) else "norms"
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


# ---- the runs ---------------------------------------------------------------------------------

# --variant: quant_gpu's weight formats. fp8_channel quantizes the dummy bf16 weights at load
# (quantization="fp8"); the others are a folder whose config carries the quantization_config.
VARIANTS = ("bf16", "fp8_channel", "fp8_block", "int4_g128")


def _engine(folder: Path, smoke: bool, eager: bool, max_model_len: int,
            variant: str = "bf16") -> offline_runs.Engine:
    kw: dict[str, Any] = dict(load_format="dummy", dtype="float32" if smoke else "bfloat16",
                              max_model_len=max_model_len, max_num_seqs=8,
                              kv_cache_memory_bytes=(32 << 20) if smoke else 4 << 30,
                              enforce_eager=eager)
    if variant == "fp8_channel":
        kw["quantization"] = "fp8"
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


def eager_section(args: argparse.Namespace, folder: Path, cfg: dict[str, Any],
                  weights: dict[str, Any]) -> tuple[dict[str, Any], StepFigures | None]:
    """weights: filled with model_weights of this engine's model (a MoE's floor)."""
    import torch

    from shoal import SamplingParams

    eng = _engine(folder, args.smoke, True, args.max_model_len, args.variant)
    llm, vocab = eng.llm, int(cfg["vocab_size"])
    runner = engine_internals.runner(llm)
    if runner is None:
        raise RuntimeError("the eager profile needs the engine's runner (engine internals)")
    weights |= model_weights(llm, cfg) or {}
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


def graph_section(args: argparse.Namespace, folder: Path, cfg: dict[str, Any],
                  weights: dict[str, Any]) -> dict[str, Any]:
    """weights: as eager_section's, where it is still empty (--sections graph)."""
    from shoal import SamplingParams

    eng = _engine(folder, args.smoke, False, args.max_model_len, args.variant)
    llm = eng.llm
    if not weights:
        weights |= model_weights(llm, cfg) or {}
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


def config_folder(model: str) -> Path | None:
    """The folder of --model's config.json: a folder as given, a shipped name
    (offline_runs.shipped_folder: deepseek-ai/DeepSeek-V2-Lite, Qwen/Qwen3-30B-A3B, ...) or a
    folder name under shoal/model_configs (deepseek-v2-lite); None when none has one."""
    for folder in (offline_runs.shipped_folder(model),
                   Path(shoal_source() or ".", "shoal", "model_configs", model)):
        if (folder / "config.json").is_file():
            return folder
    return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common(ap, out=REQUIRED, smoke="CPU, float32, a tiny config (--smoke-model)")
    ap.add_argument("--model", default=None,
                    help="a config folder, a folder name under shoal/model_configs or a "
                         "shipped name (offline_runs.SHIPPED_CONFIGS, e.g. "
                         f"deepseek-ai/DeepSeek-V2-Lite); default {DEFAULT_MODEL}")
    ap.add_argument("--smoke-model", choices=sorted(SMOKE_CONFIGS), default="gpt-oss",
                    help="--smoke without --model: gpt_oss_gpu's or deepseek_gpu's tiny "
                         "config (default gpt-oss)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps profiled (default 8)")
    ap.add_argument("--context", type=int, default=128, help="prompt ids (default 128)")
    ap.add_argument("--replays", type=int, default=20, help="graph replays (default 20)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed (default 25)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--sections", default="eager,graph", help="eager, graph or both")
    ap.add_argument("--variant", choices=VARIANTS, default="bf16",
                    help="weight format of a dense model (quant_gpu.py's variants; the floor "
                         "then counts its bytes a weight: quant_gpu.weight_floor)")
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
        folder = config_folder(args.model)
        if folder is None:
            ap.error(f"--model {args.model!r}: no config.json there, under "
                     "shoal/model_configs, or in offline_runs.SHIPPED_CONFIGS")
    elif args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="stepprof-smoke-")
        folder = Path(tmp.name)
        (folder / "config.json").write_text(json.dumps(SMOKE_CONFIGS[args.smoke_model]))
        args.max_model_len = min(args.max_model_len, 256)
        args.context = min(args.context, 16)
    else:
        folder = Path(shoal_source() or ".", "shoal", "model_configs", DEFAULT_MODEL)
    cfg = json.loads((folder / "config.json").read_text())
    if args.variant in quant_gpu.QUANT_CONFIGS:
        tmp = tmp or tempfile.TemporaryDirectory(prefix="stepprof-variant-")
        folder = quant_gpu.variant_folder(args.variant, folder, Path(tmp.name))
    rec: dict[str, Any] = dict(model=str(folder), model_type=cfg.get("model_type"),
                               smoke=args.smoke, batch=1, context=args.context,
                               decode_steps=args.steps, variant=args.variant)
    eager, weights = None, dict[str, Any]()  # weights: a MoE model's moe_active_bytes
    try:
        if "eager" in sections:
            rec["eager"], eager = eager_section(args, folder, cfg, weights)
            _free()  # the eager engine's weights and cache, before the next one
        if "graph" in sections and not args.smoke:
            rec["graph"] = graph_section(args, folder, cfg, weights)
    except Exception as e:  # what ran so far is kept
        import traceback

        traceback.print_exc()
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["floor"] = floor_table(cfg, 4 if args.smoke else 2, offline_runs.copy_bandwidth(),
                               eager, weights or None)
    if args.variant != "bf16":  # the table above counts the linears in the engine dtype
        rec["variant_floor"] = quant_gpu.weight_floor(cfg, args.variant)
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
    if f.get("bytes_per_token"):
        print(f"floor: {f['bytes_per_token']:,.0f} B a token, {f['floor_us']:.1f} us")
    for p in f.get("parts", []):
        print(f"  floor {p['part']:15s} {p['bytes']:15,.0f} B {p['floor_us']:8.1f} us  "
              f"eager {p['eager_kernel_us']}")


if __name__ == "__main__":
    sys.exit(1 if "error" in main() else 0)

