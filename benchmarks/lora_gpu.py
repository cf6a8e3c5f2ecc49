"""LoRA on one GPU (written for an H200): the batched adapter kernels against the torch path,
greedy agreement of LoRA against the merged weights, and the Llama-3.1-8B shape's throughput
with 0, 1, 4 and 16 distinct rank-16 adapters in a W1 batch and batch-1 decode with one
adapter, each against the same engine without LoRA.

    python benchmarks/lora_gpu.py all --out bench-work/lora-h200.json
    python benchmarks/lora_gpu.py kernels,correctness,w1,batch1 --num-requests 128 --out F
    python benchmarks/lora_gpu.py all --smoke --out /tmp/lora.json   # CPU, tiny sizes

Parts (one JSON record each; the file is rewritten after every part):

- kernels: each Triton path of shoal.lora.ops.lora_triton (split-K, segmented) against the
  torch path at the 8B shape's projections (qkv 4096 -> 6144 in three sub-projections, o,
  gate_up 4096 -> 28672 in two, down 14336 -> 4096), rank 16, 16 slots, steps of 1, 16, 32,
  64, 128, 256 and 2,048 tokens over 1 or 16 adapters: max |difference|, the time per call
  inside a CUDA graph (and eager), the base projection's matmul, the faster path and the one
  the threshold picks. --segmented-min-tokens N moves the threshold for every part.
- correctness: a small random Llama (4 layers, hidden 1024) written to disk with two random
  rank-16 adapters; the LoRA engine (CUDA graphs) against an engine on each adapter's merged
  weights (W + scale B A): the share of greedy tokens equal, the first divergence. bf16:
  near ties may diverge; reported, not failed. Each engine has a fixed 2 GiB KV cache, so
  the order they are built in does not matter.
- w1: the 8B shape (load_format=dummy), enable_lora, max_loras 16, W1 requests spread round
  robin over 0 (base), 1, 4 and 16 adapters; and an engine without enable_lora (base): output
  tok/s and each ratio to the base engine. Every adapter is read into host memory and its
  device slot (add_lora) before the timed runs, the reads timed apart (adapter_loads): a
  cold adapter is read inside the step that first needs it, stalling it (before this, the
  16-adapter run alone read 12 adapters of 84 MB inside its timed window). The prefix cache
  is emptied before each run: the LoRA engine runs the same prompts four times, and a
  request whose adapter is the same as in the run before (a quarter of them in the 4- and
  16-adapter runs) would otherwise find its prompt's blocks cached.
- batch1: 128 prompt ids, 256 tokens, greedy: the LoRA engine with one adapter and with none,
  the base engine; the ratios.

The adapters are random (PEFT layout, written from the engine's LoRA targets)."""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import offline_runs
from results_file import record, write

PARTS = ("kernels", "correctness", "w1", "batch1")
LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(path: Path, targets: dict[str, tuple[int, int]], seed: int, rank: int,
                  scale: float = 0.02, dtype: str = "bfloat16") -> Path:
    """A random PEFT adapter of every projection in `targets` (name -> (in, out))."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (n_in, n_out) in targets.items():
        key = f"base_model.model.{name}"
        tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, n_in, generator=gen)
                                           * scale).to(getattr(torch, dtype))
        tensors[f"{key}.lora_B.weight"] = (torch.randn(n_out, rank, generator=gen)
                                           * scale).to(getattr(torch, dtype))
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": list(LEAVES)}))
    return path


def lora_targets(llm: Any) -> dict[str, tuple[int, int]]:
    return dict(llm.llm_engine.inputs.limits.lora.targets)


def _time(fn: Any, iters: int) -> float:
    import torch

    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1000


def release(llm: Any = None) -> None:
    """An engine shut down and what it held on the device given back: shoal's
    gpu_memory_utilization caps the whole device's use, so a later engine of this process
    would otherwise count a dropped one's memory as taken."""
    import torch

    if llm is not None:
        llm.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _graph_us(fn: Any, reps: int, iters: int = 10) -> float:
    """Microseconds per call of fn, captured `reps` times in one CUDA graph and replayed:
    the device time with launch gaps as the engine's graphs see them, without the host's
    Python and launch overhead (which eager timings add)."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(0)  # compiles, outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(reps):
            fn(r)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / (iters * reps)


def _kernel_row(name: str, n_in: int, offsets: tuple[int, ...], n_out: int, tokens: int,
                adapters: int, rank: int, slots: int, smoke: bool) -> dict[str, Any]:
    """One projection, step size and adapter count: each Triton path (and the automatic
    choice) against the torch path, timed eager and in a CUDA graph, beside the base
    matmul. The adapter buffers rotate over copies worth about twice an H100's L2, so that
    (with 16 adapters) their reads come from HBM as in the engine, where every layer has its
    own."""
    import torch

    from shoal.lora.ops import add_lora, lora_triton

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*shape: int, scale: float = 1.0) -> Any:
        return torch.randn(*shape, device=device, dtype=dtype, generator=g) * scale
    x, w = randn(tokens, n_in), randn(n_out, n_in, scale=0.02)
    per_copy = slots * (len(offsets) * rank * n_in + n_out * rank) * x.element_size()
    copies = max(1, min(16, (100 << 20) // per_copy)) if cuda else 1
    ab = [(randn(slots, len(offsets) * rank, n_in, scale=0.02),
           randn(slots, n_out, rank, scale=0.02)) for _ in range(copies)]
    ids = torch.arange(tokens, device=device, dtype=torch.int32) % adapters
    y0 = x @ w.T
    want = y0.clone()
    add_lora(want, x, *ab[0], ids, offsets, rank, use_triton=False)
    row: dict[str, Any] = {"projection": name, "tokens": tokens, "adapters": adapters,
                           "in": n_in, "out": n_out,
                           "auto_path": lora_triton.choose_path(tokens, slots, len(offsets),
                                                                rank),
                           "max_abs_delta": float((want - y0).abs().max())}
    iters = 20 if not smoke else 2
    for path in ("split_k", "segmented"):
        y = y0.clone()
        lora_triton.add_lora(y, x, *ab[0], ids, offsets, rank, path=path)
        row[f"max_abs_diff_{path}_vs_torch"] = float((y.float() - want.float()).abs().max())
        run = functools.partial(lora_triton.add_lora, y0.clone(), x, *ab[0], ids, offsets,
                                rank, path=path)
        row[f"{path}_eager_ms"] = _time(run, iters)
        if cuda:
            yg = y0.clone()
            row[f"{path}_graph_us"] = _graph_us(
                lambda r, _p=path, _y=yg: lora_triton.add_lora(_y, x, *ab[r % copies], ids,
                                                                offsets, rank, path=_p),
                reps=max(20, copies))
    if cuda:
        out = torch.empty(tokens, n_out, device=device, dtype=dtype)
        row["base_matmul_graph_us"] = _graph_us(lambda r: torch.matmul(x, w.T, out=out), 20)
        best = min(row["split_k_graph_us"], row["segmented_graph_us"])
        row["best_path"] = "split_k" if best == row["split_k_graph_us"] else "segmented"
        row["best_vs_base"] = best / row["base_matmul_graph_us"]
    row["base_matmul_eager_ms"] = _time(functools.partial(torch.matmul, x, w.T), iters)
    return row


def kernels(args: argparse.Namespace) -> dict[str, Any]:
    """The Triton LoRA paths at the 8B shape's projections (qkv 4096 -> 6144 in three
    sub-projections, o 4096 -> 4096, gate_up 4096 -> 28672 in two, down 14336 -> 4096), rank
    16, 16 slots, for steps of 1 to 2,048 tokens over 1 or 16 adapters (round robin): which
    path is faster where, so the threshold (lora_triton.SEGMENTED_MIN_TOKENS, also
    --segmented-min-tokens) can be set from one run. Smoke: tiny shapes on the CPU, the
    Triton paths in its interpreter."""
    from shoal.lora.ops import lora_triton

    hidden, kv, inter = (4096, 1024, 14336) if not args.smoke else (64, 16, 128)
    shapes = {"qkv": (hidden, (0, hidden, hidden + kv), hidden + 2 * kv),
              "o": (hidden, (0,), hidden),
              "gate_up": (hidden, (0, inter), 2 * inter), "down": (inter, (0,), hidden)}
    rank, slots = 16, 16
    rows = []
    for tokens in ((1, 16, 32, 64, 128, 256, 2048) if not args.smoke else (1, 8, 40)):
        for adapters in ((1, 16) if tokens > 1 else (1,)):
            for name, (n_in, offsets, n_out) in shapes.items():
                rows.append(_kernel_row(name, n_in, offsets, n_out, tokens, adapters, rank,
                                        slots, args.smoke))
                print(json.dumps(rows[-1]), flush=True)
    return record("lora_kernels", "shoal", rank=rank, slots=slots,
                  segmented_min_tokens=lora_triton.SEGMENTED_MIN_TOKENS,
                  timing="graph_us: per call inside a CUDA graph of repeated calls (the "
                         "engine's view); eager_ms: host-timed, launch overhead included",
                  rows=rows)


def _small_llama(folder: Path, smoke: bool) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=4096 if not smoke else 512,
                      hidden_size=1024 if not smoke else 64,
                      intermediate_size=2816 if not smoke else 128, num_hidden_layers=4,
                      num_attention_heads=8 if not smoke else 4, num_key_value_heads=4 if not
                      smoke else 2, max_position_embeddings=2048, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16 if not smoke else torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.2 * (64 / p.shape[1]) ** 0.5)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _merge(base: Path, adapter: Path, out: Path) -> Path:
    """The base checkpoint with W + (alpha / r) B A in every adapted projection."""
    import shutil

    from safetensors.torch import load_file, save_file

    cfg = json.loads((adapter / "adapter_config.json").read_text())
    scale = cfg["lora_alpha"] / cfg["r"]
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    weights = load_file(str(base / "model.safetensors"))
    for key in list(weights):
        name = "base_model.model." + key.removesuffix(".weight")
        a = lora.get(f"{name}.lora_A.weight")
        if a is not None:
            b = lora[f"{name}.lora_B.weight"]
            w = weights[key]
            weights[key] = (w.float() + scale * b.float() @ a.float()).to(w.dtype)
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    save_file(weights, str(out / "model.safetensors"))
    return out


def correctness(args: argparse.Namespace) -> dict[str, Any]:
    import random

    from shoal import LLM, SamplingParams
    from shoal.lora.request import LoRARequest

    work = Path(tempfile.mkdtemp(prefix="lora-gpu-"))
    base = _small_llama(work / "base", args.smoke)
    # A fixed KV budget, not gpu_memory_utilization (a cap on the whole device's use, which
    # counted the LoRA engine's leftovers against the reference engines built after it)
    kw = dict(device=args.device, dtype=args.dtype, max_model_len=1024,
              kv_cache_memory_bytes=2 << 30) if not args.smoke else dict(device="cpu")
    llm = LLM(str(base), enable_lora=True, max_loras=2, max_lora_rank=16, **kw)
    targets = lora_targets(llm)
    adapters = [write_adapter(work / f"a{i}", targets, seed=i + 1, rank=16, scale=0.05,
                              dtype="float32") for i in range(2)]
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 4000 if not args.smoke else 500) for _ in range(n)]
               for n in (20, 75, 150, 300)]
    # logprobs=2: at a first divergence, how far apart the two candidates were (a near tie of
    # bf16 rounding, or a real difference)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    loras = [LoRARequest(f"a{i}", i + 1, str(a)) for i, a in enumerate(adapters)]
    batch = [{"prompt_token_ids": p} for p in prompts] * 3
    got = llm.generate(batch, sp, lora_request=[None] * 4 + [loras[0]] * 4 + [loras[1]] * 4,
                       use_tqdm=False)
    release(llm)
    del llm
    results = []
    for i, adapter in enumerate([None, *adapters]):
        folder = base if adapter is None else _merge(base, adapter, work / f"merged{i}")
        ref = LLM(str(folder), **kw)
        want = ref.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        release(ref)
        del ref
        for j, w in enumerate(want):
            g_out, w_out = got[4 * i + j].outputs[0], w.outputs[0]
            g, w = g_out.token_ids, w_out.token_ids
            first = next((k for k, (x, y) in enumerate(zip(g, w)) if x != y), None)
            results.append({"adapter": i, "prompt_len": len(prompts[j]),
                            "equal_share": sum(x == y for x, y in zip(g, w)) / len(w),
                            "first_divergence": first,
                            "gap_at_divergence": None if first is None else {
                                "lora": _top2_gap(g_out.logprobs, first, g[first], w[first]),
                                "merged": _top2_gap(w_out.logprobs, first, w[first], g[first])}})
    print(json.dumps(results), flush=True)
    return record("lora_correctness", "shoal", dtype=args.dtype, rank=16,
                  reference="the same engine on merged weights W + scale B A, no LoRA",
                  results=results,
                  mean_equal_share=sum(r["equal_share"] for r in results) / len(results))


def _top2_gap(logprobs: Any, pos: int, chosen: int, other: int) -> float | None:
    """logprob(chosen) - logprob(other) at step pos (None: other not in the top 2 returned)."""
    if not logprobs or pos >= len(logprobs):
        return None
    step = logprobs[pos]
    if chosen not in step or other not in step:
        return None
    return float(step[chosen].logprob - step[other].logprob)


def _engines(args: argparse.Namespace) -> tuple[Any, Any, list[Any]]:
    """The LoRA engine with its 16 adapters, built once for w1 and batch1, and the base one."""
    from shoal import LLM
    from shoal.lora.request import LoRARequest

    if getattr(args, "_engines", None) is not None:
        return args._engines
    model = args.model if not args.smoke else offline_runs.tiny_llama(
        Path(tempfile.mkdtemp()), vocab=512)
    kw = dict(load_format="dummy", dtype=args.dtype, max_model_len=4096,
              gpu_memory_utilization=0.45) if not args.smoke else dict(
        device="cpu", max_model_len=2048, load_format="dummy")
    lora_llm = LLM(model, enable_lora=True, max_loras=16, max_lora_rank=16,
                   max_cpu_loras=16, **kw)
    work = Path(tempfile.mkdtemp(prefix="lora-8b-"))
    targets = lora_targets(lora_llm)
    t0 = time.perf_counter()
    loras = [LoRARequest(f"a{i}", i + 1, str(write_adapter(work / f"a{i}", targets, i + 1,
                                                          16)))
             for i in range(16)]
    print(f"16 adapters written in {time.perf_counter() - t0:.1f} s", flush=True)
    # (the cap is the device's whole use: the LoRA engine's 0.45 is in it)
    base_llm = LLM(model, **{**kw, "gpu_memory_utilization": 0.9} if not args.smoke else kw)
    args._engines = (lora_llm, base_llm, loras)
    return args._engines


def preload(llm: Any, loras: list[Any]) -> dict[str, Any]:
    """Each adapter not yet loaded read into host memory and a free device slot (add_lora),
    timed: what a cold adapter's first step waits for."""
    engine = llm.llm_engine
    times = []
    for lora in loras:
        if lora.lora_int_id in engine.list_loras():
            continue
        t0 = time.perf_counter()
        engine.add_lora(lora)
        times.append(time.perf_counter() - t0)
    return {"read": len(times), "total_s": sum(times),
            "per_adapter_s": sum(times) / len(times) if times else None}


def _fresh_cache(llm: Any) -> None:
    if not llm.llm_engine.core.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be emptied: requests hold blocks")


def w1(args: argparse.Namespace) -> dict[str, Any]:
    lora_llm, base_llm, loras = _engines(args)
    n = args.num_requests if not args.smoke else 8
    prompts, params, ins, outs = offline_runs.w1_requests(
        n, 10000 if not args.smoke else 500,
        **({} if not args.smoke else dict(in_range=(8, 32), out_range=(8, 32))))
    loads = preload(lora_llm, loras)
    print("adapter loads", json.dumps(loads), flush=True)
    _fresh_cache(base_llm)
    base = offline_runs.throughput(base_llm, prompts, params)
    rows = {"base_engine": base}
    for k in (0, 1, 4, 16):
        _fresh_cache(lora_llm)
        chosen = [None] * n if k == 0 else [loras[i % k] for i in range(n)]
        orig = lora_llm.generate

        def generate(p, sp, use_tqdm=False, _c=chosen, _g=orig):
            return _g(p, sp, use_tqdm=use_tqdm,
                      lora_request=_c if len(p) == n else _c[:len(p)])
        lora_llm.generate = generate
        try:
            fig = offline_runs.throughput(lora_llm, prompts, params)
        finally:
            lora_llm.generate = orig
        fig["vs_base_engine"] = fig["output_tok_s"] / base["output_tok_s"]
        rows[f"adapters_{k}"] = fig
        print(k, json.dumps(fig), flush=True)
    return record("lora_w1", "shoal", model=args.model, num_requests=n, rank=16, max_loras=16,
                  total_input_tokens=sum(ins), expected_output_tokens=sum(outs),
                  adapter_loads=loads, **rows)


def batch1(args: argparse.Namespace) -> dict[str, Any]:
    lora_llm, base_llm, loras = _engines(args)
    hi = 10000 if not args.smoke else 500
    inp, out = (128, 256) if not args.smoke else (16, 16)
    base = offline_runs.batch1(base_llm, hi, inp, out)
    none = offline_runs.batch1(lora_llm, hi, inp, out)
    orig = lora_llm.generate
    lora_llm.generate = lambda p, sp, use_tqdm=False: orig(p, sp, use_tqdm=use_tqdm,
                                                           lora_request=loras[0])
    try:
        one = offline_runs.batch1(lora_llm, hi, inp, out)
    finally:
        lora_llm.generate = orig

    def ratio(fig: dict) -> float | None:
        a, b = fig.get("decode_tok_s"), base.get("decode_tok_s")
        return a / b if a and b else None
    return record("lora_batch1", "shoal", model=args.model, input_len=inp, output_len=out,
                  base_engine=base, lora_engine_no_adapter=none, lora_engine_one_adapter=one,
                  no_adapter_vs_base=ratio(none), one_adapter_vs_base=ratio(one))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("parts", help=f"all, or a comma list of {', '.join(PARTS)}")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=offline_runs.LLAMA_8B)
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--segmented-min-tokens", type=int, default=None,
                    help="steps of at least this many tokens take the segmented LoRA kernels "
                         "(lora_triton.SEGMENTED_MIN_TOKENS; every part, engines included)")
    args = ap.parse_args()
    if args.smoke:
        args.dtype = "float32"
        import torch

        if not torch.cuda.is_available():  # the Triton paths in its interpreter (CPU tensors)
            os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.segmented_min_tokens is not None:
        from shoal.lora.ops import lora_triton

        lora_triton.SEGMENTED_MIN_TOKENS = args.segmented_min_tokens
    parts = PARTS if args.parts == "all" else tuple(args.parts.split(","))
    records, failed = [], False
    for part in parts:
        t0 = time.perf_counter()
        try:
            rec = globals()[part](args)
        except Exception:
            traceback.print_exc()
            rec, failed = record(f"lora_{part}", "shoal", error=traceback.format_exc()), True
        rec["part_wall_s"] = time.perf_counter() - t0
        release()  # (the kernels' test tensors, a part's dropped engines)
        records.append(rec)
        write(records, args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
