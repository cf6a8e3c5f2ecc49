"""What one prefill step of a hybrid linear-attention model asks of the device, counted on the
CPU (issue 30: hybrid TTFT on the H100 was several times its work): host syncs, torch ops per
layer kind, and how those counts grow with the prompt, against a full-attention model.

    PYTHONPATH=.:benchmarks .venv/bin/python benchmarks/hybrid_prefill_trace.py \
        [--tokens 128,256] [--out FILE.json]

Tiny random models (hybrid_gpu's smoke configs: Qwen3.5 and Kimi-Linear, 3 linear + 1 full
layer, hidden 64; and the Qwen3.5 one with every layer full attention, as a Llama-like
baseline), float32, load_format="dummy", prefix caching on (a prefill writes the states at
its block ends). One request of N prompt tokens, max_tokens=1: the runner's execute() of its
prefill step runs under a TorchDispatchMode that counts

- syncs: what makes a CUDA host wait for the device, seen on the CPU by the aten op that
  carries it: _local_scalar_dense (.item(), bool(t), int(t)), nonzero / unique / masked_select
  (data-dependent shapes), plus Python-level .tolist() / .cpu() / .numpy() calls and
  torch.tensor(python values, device=the model's device), which on CUDA is a blocking copy
  (shoal.host_to_device.to_device stages through pinned memory instead: not a sync);
- ops: every aten op (about one kernel launch each on CUDA), split by the layer they run in
  (LinearAttention subclasses, the paged Attention modules, the rest).

A count that grows with N in a linear layer is a Python loop over tokens, chunks or blocks."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = ("_local_scalar_dense", "nonzero", "unique", "masked_select")
ATTENTION_MODULES = ("Attention", "LatentAttention", "MLAAttention")
HOST_ONLY = ("lift_fresh", "detach_")  # torch.tensor(values): counted by tagged() instead
SKIP_OPS = ("detach", "view", "_unsafe_view", "alias", "t.", "unsqueeze", "squeeze",
            "expand", "as_strided", "select.", "slice.", "split", "unbind", "transpose",
            "permute", "unflatten", "reshape", "_reshape_alias", "diagonal.", "narrow")


def _is_view(name: str) -> bool:
    """Ops that launch nothing on a GPU (metadata only)."""
    base = name.split(".")[0]
    return base in {s.rstrip(".") for s in SKIP_OPS}


class StepCounter(TorchDispatchMode):
    """Counts aten ops by the innermost tagged module they run in (see tag())."""

    def __init__(self) -> None:
        super().__init__()
        self.where: list[str] = ["other"]
        self.ops: Counter = Counter()
        self.syncs: Counter = Counter()
        self.names: dict[str, Counter] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        part = self.where[-1]
        base = name.split(".")[0]
        if base in HOST_ONLY:
            return func(*args, **(kwargs or {}))
        if base in SYNC_OPS:
            self.syncs[f"{part}:{base}"] += 1
        out = func(*args, **(kwargs or {}))
        if base not in SYNC_OPS and not _is_view(name) and not (args and out is args[0]
                                                                 and base == "to"):
            self.ops[part] += 1  # (a .to() that returns its input launches nothing)
            self.names.setdefault(part, Counter())[base] += 1
        return out

    def python_sync(self, what: str) -> None:
        self.syncs[f"{self.where[-1]}:{what}"] += 1


@contextmanager
def tagged(counter: StepCounter, model: torch.nn.Module):
    """Each LinearAttention / Attention module's forward counts under its kind; Python-level
    syncs (.tolist, .cpu, .numpy) count too."""
    from shoal.layers.linear_attention import LinearAttention

    handles = []
    for mod in model.modules():
        kind = ("linear" if isinstance(mod, LinearAttention)
                else "attention" if type(mod).__name__ in ATTENTION_MODULES else None)
        if kind is None:
            continue
        handles.append(mod.register_forward_pre_hook(
            lambda m, a, k=kind: counter.where.append(k)))
        handles.append(mod.register_forward_hook(
            lambda m, a, o: counter.where.pop() and None))  # (None: keep the output)
    saved = {n: getattr(torch.Tensor, n) for n in ("tolist", "cpu", "numpy")}

    def counting(n: str):
        orig = saved[n]

        def f(self, *a, **k):
            counter.python_sync(n)
            return orig(self, *a, **k)
        return f
    for n in saved:
        setattr(torch.Tensor, n, counting(n))
    device = next(model.parameters()).device
    make = torch.tensor

    def tensor(*a, **k):
        if k.get("device") is not None and torch.device(k["device"]) == device:
            counter.python_sync("tensor(device=)")
        return make(*a, **k)
    torch.tensor = tensor
    try:
        yield
    finally:
        torch.tensor = make
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)
        for h in handles:
            h.remove()


def trace_prefill(model_dir: str, lengths: list[int]) -> list[dict[str, Any]]:
    """Counts of the execute() of an N-token prefill step (one request, max_tokens=1) for
    each N, in one engine (prompts of different ids: no prefix-cache hits)."""
    import engine_internals

    from shoal import LLM, SamplingParams
    from shoal.layers.linear_attention import LinearAttention

    llm = LLM(model=model_dir, load_format="dummy", dtype="float32", skip_tokenizer_init=True,
              max_model_len=1024, max_num_batched_tokens=1024,
              kv_cache_memory_bytes=64 << 20, enforce_eager=True)
    try:
        runner = engine_internals.core(llm, required=True).runner
        model = runner.model
        n_linear = sum(isinstance(m, LinearAttention) for m in model.modules())
        n_attn = sum(type(m).__name__ in ATTENTION_MODULES for m in model.modules())
        execute, out = runner.execute, []
        # one untraced prefill first: what a model builds lazily on its first step (a rotary
        # table, without the C++ CPU kernels) must not count against the first length
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=1),
                     use_tqdm=False)
        for i, tokens in enumerate(lengths):
            counter = StepCounter()

            def traced(sched, counter=counter):
                if sched.num_decodes or sched.is_empty:
                    return execute(sched)
                with tagged(counter, model), counter:
                    return execute(sched)
            runner.execute = traced
            try:
                prompt = [3 + (7 * i + j) % 500 for j in range(tokens)]
                llm.generate([{"prompt_token_ids": prompt}],
                             SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
            finally:
                del runner.execute
            out.append({
                "tokens": tokens, "linear_layers": n_linear, "attention_layers": n_attn,
                "block_size": runner.block_size, "ops": dict(counter.ops),
                "syncs": dict(counter.syncs),
                "linear_ops_per_layer": round(counter.ops["linear"] / max(n_linear, 1), 1),
                "attention_ops_per_layer": round(counter.ops["attention"] / max(n_attn, 1), 1),
                "top_linear_ops": counter.names.get("linear", Counter()).most_common(12)})
        return out
    finally:
        llm.shutdown()


def model_dirs(root: Path) -> dict[str, str]:
    from hybrid_gpu import SMOKE_CONFIGS, all_full_attention

    out = {}
    for name, cfg in SMOKE_CONFIGS.items():
        if cfg["model_type"] not in ("qwen3_5_text", "kimi_linear"):
            continue
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_text(json.dumps(cfg))
        out[name] = str(root / name)
        if cfg["model_type"] == "qwen3_5_text":
            (root / "full-attention").mkdir()
            (root / "full-attention" / "config.json").write_text(
                json.dumps(all_full_attention(cfg)))
            out["full-attention"] = str(root / "full-attention")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tokens", default="128,256")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    res = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in model_dirs(Path(tmp)).items():
            for rec in trace_prefill(path, [int(t) for t in args.tokens.split(",")]):
                rec = {"model": name, **rec}
                print(json.dumps(rec), flush=True)
                res.append(rec)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
