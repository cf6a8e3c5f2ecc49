"""Quantized weights on one GPU (written for an H100/H200): the fast path's kernels per shape,
and batch-1 decode of the Llama-3.1-8B shape in bf16, FP8 and INT4 (random weights).

    python benchmarks/quant_gpu.py all --out bench-work/quant-h200.json
    python benchmarks/quant_gpu.py kernels | decode --out FILE
    python benchmarks/quant_gpu.py all --smoke --out /tmp/quant.json   # CPU, tiny sizes

Parts (one JSON record each, written to --out after every part):

- kernels: Llama-3.1-8B's projections (qkv 6144x4096, o 4096x4096, gate_up 28672x4096,
  down 4096x14336) at M = 1, 4, 16, 64, 256, 2048 tokens; per shape the median time (CUDA
  events, after warm-up) of: bf16 (x @ W^T: what a layer runs on the dequantize-at-load
  path, SHOAL_QUANT_DEQUANT=1), fp8_channel (per-token activation quantization +
  torch._scaled_mm), fp8_block (per-token-group quantization + the Triton block GEMM),
  int4_g128 (the Triton W4A16 GEMM, symmetric group 128) and int4_dequant (the same weight
  dequantized on the fly, then one bf16 matmul: the large-M alternative that
  SHOAL_W4A16_DENSE_ABOVE_M selects); each with its weight bytes and the bandwidth that
  reading them once in that time implies. At M <= 8 the quantized layers time their
  launch candidates once (launch_tuner.py: weight-only GEMVs beside the kernels named above)
  and run the fastest; `tuned` lists every candidate's time and the pick.
- decode: for each of bf16, fp8_channel (quantization="fp8": online FP8 of the dummy
  weights), fp8_block (a config with quantization_config fp8, weight_block_size [128, 128])
  and int4_g128 (a config with quantization_config gptq 4-bit, group 128): one engine in its
  own subprocess (load_format="dummy"; the GPU is empty for each), batch-1 decode as
  offline_runs.batch1 (128 prompt ids, 256 output tokens, greedy, median of 3), and the
  weight-read floor of a decode token (the linear weights' packed bytes + the rest in bf16)
  at the GPU's copy bandwidth (offline_runs.copy_bandwidth: H200 4.25, H100 3.0 TB/s).
  With --serve, each variant's engine then starts once more as `shoal serve` (the same
  settings) and batch-1 decode is measured through it too (served_decode.py: streamed
  /v1/completions, fresh prompts, median of --repeats): `served` and `served_over_offline`.

--smoke: tiny shapes and a 2-layer, 64-wide Llama on the CPU in float32 (Triton under
TRITON_INTERPRET=1); the fast path is CUDA-only, so the smoke engines run dense: it checks
the script, not the speed."""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import offline_runs
from bench_args import add_common, comma_words
from offline_runs import LLAMA_8B, copy_bandwidth
from results_file import record, write
from served_decode import model_name, served_batch1
from server_process import SHOAL_CLI, ServerProcess, free_port

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}
MS = (1, 4, 16, 64, 256, 2048)
SMOKE_SHAPES = {"qkv": (96, 64), "down": (64, 128)}
SMOKE_MS = (1, 3)
VARIANTS = ("bf16", "fp8_channel", "fp8_block", "int4_g128")
QUANT_CONFIGS = {
    "fp8_block": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                  "weight_block_size": [128, 128]},
    "int4_g128": {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
                  "desc_act": False},
}
# bytes per weight of each variant's linear layers (scales included: g128 fp16, block fp32)
BYTES_PER_WEIGHT = {"bf16": 2.0, "fp8_channel": 1.0, "fp8_block": 1.0 + 4 / 128**2,
                    "int4_g128": 0.5 + 2 / 128}


def timer(fn: Any, device: str, reps: int) -> float:
    """Median seconds of fn() after warm-up; on CUDA as replays of a graph of fn (the launch
    tuner's timing: eager launches from this host would be timed instead of the GPU)."""
    import torch

    if device == "cuda":
        from shoal.layers.quantization.launch_tuner import gpu_time_us

        us = gpu_time_us(fn)
        if us == float("inf"):
            raise RuntimeError("could not be captured or launched (see the debug log)")
        return us / 1e6
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def kernel_part(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from shoal.layers.quantization.methods import make_quant_linear
    from shoal.quantization.packed import quantize_fp8, quantize_int4

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    shapes, ms = (SMOKE_SHAPES, SMOKE_MS) if args.smoke else (SHAPES, MS)
    reps = 3 if args.smoke else args.repeats
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device) * 0.02
        methods = {
            "fp8_channel": make_quant_linear(quantize_fp8(w), torch.device(device)),
            "fp8_block": make_quant_linear(quantize_fp8(w, (128, 128) if not args.smoke
                                                        else (32, 32)), torch.device(device)),
            "int4_g128": make_quant_linear(quantize_int4(w, 128 if not args.smoke else 32),
                                           torch.device(device)),
        }
        dense = w.to(dtype)
        del w
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=dtype)
            fns = {"bf16": lambda x=x, w=dense: x @ w.t()}
            for key, q in methods.items():
                if q is not None:
                    fns[key] = (lambda q=q, x=x: q(x))
            q4 = methods["int4_g128"]
            if q4 is not None:
                fns["int4_dequant"] = lambda x=x, q4=q4: x @ q4.dequantize(dtype)
            row: dict[str, Any] = {"shape": name, "n": n, "k": k, "m": m}
            for key, fn in fns.items():
                try:
                    s = timer(fn, device, reps)
                except Exception as e:  # one method failing keeps the others' figures
                    row[key] = {"error": f"{type(e).__name__}: {e}"}
                    continue
                nbytes = (dense.numel() * dense.element_size() if key in ("bf16",) else
                          methods["int4_g128" if key == "int4_dequant" else key].nbytes)
                row[key] = {"us": s * 1e6, "weight_bytes": nbytes,
                            "weight_gb_s": nbytes / s / 1e9}
            base = row["bf16"].get("us")
            for key in fns:
                if key != "bf16" and "us" in row.get(key, {}) and base:
                    row[key]["speedup_vs_bf16"] = base / row[key]["us"]
            print(json.dumps({k: (round(v["us"], 1) if isinstance(v, dict) and "us" in v
                                  else v) for k, v in row.items()}), flush=True)
            rows.append(row)
    return dict(device=device, dtype=str(dtype), rows=rows, tuned=tuned_launches())


def tuned_launches() -> dict[str, Any]:
    """What the launch tuner timed in this process: per key the pick and every candidate."""
    from shoal.layers.quantization.launch_tuner import TUNED

    return {" ".join(map(str, key)): {"choice": t.choice, "times_us": {
        k: (round(v, 2) if v != float("inf") else "failed") for k, v in t.times_us.items()}}
        for key, t in TUNED.items()}


def variant_folder(variant: str, base: Path, root: Path) -> Path:
    """A folder with the shape's config.json and the variant's quantization_config."""
    cfg = json.loads((base / "config.json").read_text())
    cfg["quantization_config"] = QUANT_CONFIGS[variant]
    folder = root / variant
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def decode_one(args: argparse.Namespace) -> dict[str, Any]:
    """One variant's engine (run in a subprocess by decode_part)."""
    model, variant = args.model_path, args.variant
    kw: dict[str, Any] = dict(load_format="dummy", dtype=args.engine_dtype,
                              max_model_len=args.max_model_len, max_num_seqs=8)
    if variant == "fp8_channel":
        kw["quantization"] = "fp8"
    if args.smoke:
        kw |= {"kv_cache_memory_bytes": 32 << 20, "device": "cpu"}
    eng = offline_runs.start_engine(model, **kw)
    cfg = json.loads((offline_runs.shipped_folder(model) / "config.json").read_text())
    out = offline_runs.batch1(eng.llm, int(cfg["vocab_size"]), args.b1_in, args.b1_out,
                              runs=args.repeats)
    return dict(variant=variant, ready_s=eng.ready_s, **out, tuned=tuned_launches())


def weight_floor(cfg: dict[str, Any], variant: str) -> dict[str, Any]:
    """Bytes a batch-1 decode token reads: every linear of the decoder in the variant's
    bytes, embeddings (one row), norms and the LM head in bf16."""
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg[
        "num_attention_heads"])
    hd = cfg.get("head_dim") or h // heads
    linear = layers * (h * (heads + 2 * kv) * hd + heads * hd * h + 3 * h * inter)
    other = cfg["vocab_size"] * h + h + layers * 2 * h  # LM head, one embedding row, norms
    nbytes = linear * BYTES_PER_WEIGHT[variant] + other * 2
    bandwidth = copy_bandwidth()
    return dict(weight_bytes_per_token=nbytes, copy_bandwidth=bandwidth,
                floor_tok_s=bandwidth / nbytes)


def served_part(args: argparse.Namespace, folder: Path, variant: str, vocab: int,
                root: Path) -> dict[str, Any]:
    """The variant's batch-1 decode through `shoal serve` (same engine settings as the offline
    run, its own process, the GPU empty again): streamed requests of fresh random prompts."""
    port = free_port()
    cmd = [sys.executable, *SHOAL_CLI, "serve", str(folder), "--port", str(port),
           "--load-format", "dummy", "--dtype", args.engine_dtype,
           "--max-model-len", str(args.max_model_len), "--max-num-seqs", "8",
           "--disable-uvicorn-access-log"]
    if variant == "fp8_channel":
        cmd += ["--quantization", "fp8"]
    if args.smoke:
        cmd += ["--device", "cpu", "--kv-cache-memory-bytes", str(32 << 20)]
    rng = random.Random(1)
    prompts = [offline_runs.random_prompt(rng, args.b1_in, vocab)["prompt_token_ids"]
               for _ in range(args.repeats + 1)]
    try:
        with ServerProcess(cmd, port, log=root / f"serve-{variant}.log",
                           timeout=args.timeout) as server:
            return {"ready_s": server.ready_s,
                    **served_batch1(server.url, model_name(server.url), prompts, args.b1_out,
                                    timeout=args.timeout)}
    except Exception as e:  # the offline figure stands; say why the served one is missing
        log = root / f"serve-{variant}.log"
        return {"error": f"{type(e).__name__}: {e}",
                "log_tail": log.read_text()[-2000:] if log.exists() else ""}


def decode_part(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    base = offline_runs.shipped_folder(args.model)
    cfg = json.loads((base / "config.json").read_text())
    results = {}
    for variant in args.variants:
        folder = variant_folder(variant, base, root) if variant in QUANT_CONFIGS else base
        out = root / f"{variant}.json"
        cmd = [sys.executable, __file__, "_decode_one", "--out", str(out), "--variant", variant,
               "--model-path", str(folder), "--engine-dtype", args.engine_dtype,
               "--repeats", str(args.repeats), "--b1", f"{args.b1_in},{args.b1_out}",
               "--max-model-len", str(args.max_model_len)] + (["--smoke"] if args.smoke else [])
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        row: dict[str, Any] = weight_floor(cfg, variant)
        if proc.returncode == 0 and out.exists():
            row |= json.loads(out.read_text())
            if row.get("decode_tok_s"):
                row["fraction_of_floor"] = row["decode_tok_s"] / row["floor_tok_s"]
        else:
            row["error"] = (proc.stderr or proc.stdout)[-3000:]
        row["wall_s"] = time.perf_counter() - t0
        if args.serve:
            row["served"] = served_part(args, folder, variant, int(cfg["vocab_size"]), root)
            if (row["served"].get("decode_tok_s") or 0) and row.get("decode_tok_s"):
                row["served_over_offline"] = row["served"]["decode_tok_s"] / row["decode_tok_s"]
        print(json.dumps({k: v for k, v in row.items() if not isinstance(v, (list, dict))
                          and k != "error"}), flush=True)
        results[variant] = row
    return dict(model=args.model, dtype=args.engine_dtype, variants=results)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("parts", type=comma_words, nargs="?", default=["all"],
                   help="kernels, decode or all")
    add_common(p, out=None, model=LLAMA_8B, repeats=None,
               smoke="tiny shapes and a tiny Llama on the CPU")
    p.add_argument("--variants", type=comma_words, default=list(VARIANTS))
    p.add_argument("--timeout", type=int, default=900, help="seconds per decode engine")
    p.add_argument("--serve", action="store_true",
                   help="also each variant's batch-1 decode through `shoal serve`")
    # the subprocess of one decode engine
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    p.add_argument("--engine-dtype", default=None, help=argparse.SUPPRESS)
    p.add_argument("--b1", default=None, help=argparse.SUPPRESS)
    p.add_argument("--max-model-len", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    smoke = args.smoke
    args.repeats = args.repeats or (1 if smoke else 3)
    args.engine_dtype = args.engine_dtype or ("float32" if smoke else "bfloat16")
    b1 = (args.b1 or ("16,8" if smoke else "128,256")).split(",")
    args.b1_in, args.b1_out = int(b1[0]), int(b1[1])
    args.max_model_len = args.max_model_len or (256 if smoke else 4096)
    if smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if args.parts == ["_decode_one"]:
        write(decode_one(args), args.out)
        return 0
    if args.out is None:
        p.error("--out is required")
    parts = ["kernels", "decode"] if args.parts == ["all"] else args.parts
    records, failed = [], False
    with tempfile.TemporaryDirectory(prefix="quant_gpu_") as tmp:
        if smoke:
            args.model = offline_runs.tiny_llama(Path(tmp) / "tiny")
        for part in parts:
            try:
                figures = (kernel_part(args) if part == "kernels" else
                           decode_part(args, Path(tmp)))
                records.append(record(f"quant_{part}", "shoal", smoke=smoke, **figures))
            except Exception as e:
                failed = True
                traceback.print_exc()
                records.append(record(f"quant_{part}", "shoal", smoke=smoke,
                                      error=f"{type(e).__name__}: {e}"))
            write(records, args.out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
