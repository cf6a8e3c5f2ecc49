"""DeepSeek-V2-Lite on one GPU (written for an H200): batch-1 decode against its weight-read
floor, W1-style throughput, and the latent KV cache's bytes per token, all on random weights
(load_format="dummy"; the shipped config has no tokenizer, so prompts are token ids).

    python benchmarks/deepseek_gpu.py all --out bench-work/deepseek-h200.json
    python benchmarks/deepseek_gpu.py batch1,w1 | kv | mla --out FILE [--num-requests N]
    python benchmarks/deepseek_gpu.py all --smoke --out /tmp/ds.json   # CPU, tiny config
    python benchmarks/deepseek_gpu.py batch1,w1 --model google/gemma-3-27b-it-text --out F

Parts (one JSON record each, written to --out after every part, so a part that dies or a
run that is killed keeps the records before it):

- batch1: 128 random prompt ids, 256 output tokens, greedy, ignore_eos, median of 3 runs as
  gpu_suite.w2 (TTFT from a separate 1-token request; decode = (n - 1) / (total - TTFT); a
  fresh prompt for every run, where w2 repeats one and so may hit the prefix cache),
  plus the engine's own TTFT and decode rate of that run (RequestOutput.metrics). Weight-read
  floor: active parameters x element size / the GPU copy bandwidth, where active = every parameter
  of the built model except the routed experts' stacked weights, plus num_experts_per_tok x
  one routed expert (w13 + w2 rows of one expert) per MoE layer. At batch 1 each token runs
  exactly k experts per MoE layer, so this is the bytes one decode token reads (the whole
  embedding table is counted, as shoal counts active parameters; a token reads one row of it:
  active_params_without_embedding gives that tighter floor too).
- w1: gpu_suite.w1's requests (random ids, inputs U[100, 1024], outputs U[100, 1024],
  temperature 0.6, ignore_eos), max_num_seqs 256, max_model_len 4096.
- kv_bytes: bytes per token of the runner's KV cache tensors (one latent plane of
  kv_lora_rank + qk_rope_head_dim per layer) against a GQA/MHA cache of the same width
  (layers x 2 planes x heads x hidden/heads) and against full multi-head K/V at
  DeepSeek's own head dims (layers x heads x (qk_nope + qk_rope + v_head)).
- mla_kernel: benchmarks/mla_decode_gpu.py (another script's MLA decode kernel timings), run
  as a subprocess before the engine starts (its CUDA context cannot break the engine parts;
  the GPU is free of the engine's KV pool), V2-Lite's 16 heads unless --mla-heads says more.

For V2-Lite in bf16 these rules give: 15.71B parameters, 2.661B active (2.451B with one
embedding row) -> 5.32 GB per decode token -> 799 tok/s at 4.25 TB/s (867 with one row); KV
31,104 B per token against 221,184 for GQA of the same width (1/7.1) and 276,480 for full K/V
(1/8.9).

`all` runs mla, then builds ONE engine for kv, batch1 and w1 (in that order); exit status 1
when any part failed. The timings go through the public API (benchmarks/offline_runs.py, the
same code as gpu_suite.py); the parameter count and KV tensors come from the engine's runner
(engine_internals.py): under SHOAL_BENCH_PUBLIC_ONLY=1 the roofline figures are None and the
KV bytes come from the config. --smoke writes a tiny DeepseekV2ForCausalLM config (2 layers, hidden 64) to a
temp folder and runs every part on the CPU in float32 with small request counts (the MLA
script under TRITON_INTERPRET=1)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import engine_internals
import offline_runs
from bench_args import REQUIRED, add_common, comma_words
from offline_runs import DEEPSEEK_V2_LITE, copy_bandwidth
from results_file import record, write
from staged_gpu import LazyEngine

MODEL = DEEPSEEK_V2_LITE
MLA_SCRIPT = Path(__file__).resolve().parent / "mla_decode_gpu.py"

# The tiny config of --smoke: every structural feature of V2-Lite (no q_lora, a dense first
# layer, routed + shared experts) at toy sizes.
SMOKE_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "attention_bias": False, "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 1,
    "hidden_act": "silu", "hidden_size": 64, "intermediate_size": 128, "kv_lora_rank": 32,
    "max_position_embeddings": 512, "moe_intermediate_size": 32, "moe_layer_freq": 1,
    "n_group": 1, "n_routed_experts": 4, "n_shared_experts": 1, "norm_topk_prob": False,
    "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_key_value_heads": 4, "q_lora_rank": None, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16, "rms_norm_eps": 1e-6, "rope_scaling": None, "rope_theta": 10000,
    "routed_scaling_factor": 1.0, "scoring_func": "softmax", "tie_word_embeddings": False,
    "topk_group": 1, "topk_method": "greedy", "torch_dtype": "float32", "v_head_dim": 16,
    "vocab_size": 512}

# Workload sizes: the real run and --smoke.
FULL = dict(dtype="bfloat16", max_model_len=4096, b1_in=128, b1_out=256, w1_in=(100, 1024),
            w1_out=(100, 1024), num_requests=256, kv_cache_memory_bytes=None)
SMOKE = dict(dtype="float32", max_model_len=512, b1_in=16, b1_out=12, w1_in=(8, 40),
             w1_out=(4, 16), num_requests=6, kv_cache_memory_bytes=32 << 20)


def write_smoke_config(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(SMOKE_CONFIG, indent=2) + "\n")
    return folder


class Bench(LazyEngine):
    """The engine (built once, on first use) and what the parts share."""

    def __init__(self, args: argparse.Namespace, sizes: dict[str, Any]):
        self.args, self.sizes = args, sizes
        folder = offline_runs.shipped_folder(args.model)
        self.hf_config = SimpleNamespace(**json.loads((folder / "config.json").read_text()))
        kw: dict[str, Any] = dict(load_format="dummy", dtype=sizes["dtype"],
                                  max_model_len=sizes["max_model_len"],
                                  max_num_seqs=args.max_num_seqs)
        if sizes["kv_cache_memory_bytes"] is not None:
            kw |= {"kv_cache_memory_bytes": sizes["kv_cache_memory_bytes"], "device": "cpu"}
        super().__init__(args.model, kw)

    def vocab(self) -> int:
        return int(self.hf_config.vocab_size)

    def common(self) -> dict[str, Any]:
        return dict(model=self.args.model, dtype=self.sizes["dtype"], smoke=self.args.smoke,
                    **self.ready_fields(), max_num_seqs=self.args.max_num_seqs,
                    max_model_len=self.sizes["max_model_len"])


# ---- active parameters -------------------------------------------------------------------

def count_active(model: Any, top_k: int) -> dict[str, Any]:
    """Parameters of the model (shared tensors once) split into routed experts and the rest.
    Active per token = non-routed + top_k x one expert's params, per MoE layer. Routed experts
    are the modules holding stacked w13_weight / w2_weight with num_experts."""
    total = sum(p.numel() for p in model.parameters())
    routed = active_routed = moe_layers = per_expert = num_experts = 0
    for mod in model.modules():
        if hasattr(mod, "w13_weight") and hasattr(mod, "num_experts"):
            n = mod.w13_weight.numel() + mod.w2_weight.numel()
            per_expert, num_experts = n // mod.num_experts, mod.num_experts
            routed += n
            active_routed += top_k * per_expert
            moe_layers += 1
    active = total - routed + active_routed
    # A token reads one row of the embedding table, not all of it.
    table = getattr(getattr(getattr(model, "model", None), "embed_tokens", None), "weight", None)
    one_row = active - table.numel() + table.shape[-1] if table is not None else active
    elem = next(model.parameters()).element_size()
    return dict(total_params=total, routed_expert_params=routed,
                non_expert_params=total - routed, moe_layers=moe_layers,
                num_routed_experts=num_experts, num_experts_per_tok=top_k,
                params_per_routed_expert=per_expert, active_params=active,
                active_params_without_embedding=one_row, param_bytes=elem)


def weight_floor(model: Any, top_k: int, decode: float) -> dict[str, Any]:
    """The weight-read floor of a decode token (count_active's bytes over the GPU's copy
    bandwidth; also with one embedding row) and `decode` tok/s as a fraction of each."""
    counts = count_active(model, top_k)
    weight_bytes = counts["active_params"] * counts["param_bytes"]
    bandwidth = copy_bandwidth()
    roof = bandwidth / weight_bytes
    tight = bandwidth / (counts["active_params_without_embedding"] * counts["param_bytes"])
    return dict(weight_bytes_per_token=weight_bytes, copy_bandwidth=bandwidth,
                roofline_tok_s=roof, fraction_of_roofline=decode / roof,
                roofline_tok_s_one_embedding_row=tight,
                fraction_of_roofline_one_embedding_row=decode / tight, params=counts)


def roofline(bench: Bench, decode: float) -> dict[str, Any]:
    """The weight-read floor of a decode token, from the engine's model (an internal: None
    figures without it)."""
    model = getattr(engine_internals.runner(bench.llm), "model", None)
    if model is None:
        return dict.fromkeys(ROOFLINE_KEYS)
    cfg, s = bench.hf_config, bench.sizes
    # (a dense model: no routed experts; --model takes any decoder, e.g. Gemma-3-27B's text)
    floor = weight_floor(model, int(getattr(cfg, "num_experts_per_tok", 0) or 0), decode)
    elem = floor["params"]["param_bytes"]
    if getattr(cfg, "kv_lora_rank", None):  # one latent row a token and layer
        row = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * elem
    else:  # K and V of every KV head (every layer reads its whole context at this length)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        row = 2 * cfg.num_key_value_heads * head_dim * elem
    mean_ctx = s["b1_in"] + s["b1_out"] / 2
    return dict(
        **floor,
        kv_bytes_read_per_token_at_mean_context=int(cfg.num_hidden_layers * row * mean_ctx),
        params_counted_on="engine model (the runner's model)",
        active_params_rule=(
            "all parameters of the built model (shared tensors once) minus the routed experts' "
            "stacked w13/w2 weights, plus num_experts_per_tok x one routed expert's w13+w2 per "
            "MoE layer; router gates and shared experts count in full; at batch 1 a token runs "
            "exactly num_experts_per_tok routed experts per MoE layer"),
        roofline_rule="weight_bytes_per_token / offline_runs.copy_bandwidth(), KV reads not "
                      "included (see kv_bytes_read_per_token_at_mean_context)")


ROOFLINE_KEYS = ("weight_bytes_per_token", "copy_bandwidth", "roofline_tok_s",
                 "fraction_of_roofline", "roofline_tok_s_one_embedding_row",
                 "fraction_of_roofline_one_embedding_row",
                 "kv_bytes_read_per_token_at_mean_context", "params", "params_counted_on",
                 "active_params_rule", "roofline_rule")


# ---- parts ---------------------------------------------------------------------------------

def batch1(bench: Bench) -> dict[str, Any]:
    s = bench.sizes
    fig = offline_runs.batch1(bench.llm, bench.vocab(), s["b1_in"], s["b1_out"])
    return record("batch1", "shoal", **bench.common(), batch=1, input_len=s["b1_in"],
                  output_len=s["b1_out"], **fig, **roofline(bench, fig["decode_tok_s"] or 0),
                  graph_replay_ms=engine_internals.graph_replay_ms(bench.llm))


def w1(bench: Bench) -> dict[str, Any]:
    s = bench.sizes
    n = bench.args.num_requests or s["num_requests"]
    prompts, params, ins, outs = offline_runs.w1_requests(
        n, min(10000, bench.vocab()), in_range=s["w1_in"], out_range=s["w1_out"])
    fig = offline_runs.throughput(bench.llm, prompts, params)
    return record("w1", "shoal", **bench.common(), num_requests=n,
                  input_len_range=list(s["w1_in"]), output_len_range=list(s["w1_out"]),
                  total_input_tokens=sum(ins), expected_output_tokens=sum(outs), **fig,
                  temperature=0.6)


def kv_bytes(bench: Bench) -> dict[str, Any]:
    # The engine's cache tensors when it starts; the config's figures when it does not.
    try:
        caches = getattr(engine_internals.runner(bench.llm), "kv_caches", None)
    except Exception:
        traceback.print_exc()
        caches = None
    cfg = bench.hf_config
    layers = int(cfg.num_hidden_layers)
    heads = int(cfg.num_attention_heads)
    head_dim = int(cfg.hidden_size) // heads
    latent_dim = int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim)
    elem = 2 if bench.sizes["dtype"] == "bfloat16" else 4
    source, shapes, slots = "config", None, None
    per_token = layers * latent_dim * elem
    if caches:
        # Each cache is [planes, num_slots, kv_heads, row]; bytes per slot summed over layers.
        per_token = sum(kv.numel() // kv.shape[1] * kv.element_size() for kv in caches)
        elem = caches[0].element_size()
        shapes = [list(caches[0].shape), len(caches)]
        slots = int(caches[0].shape[1])
        source = "runner kv_caches (llm.llm_engine.core.runner.kv_caches)"
    expected = layers * latent_dim * elem
    gqa = layers * 2 * heads * head_dim * elem
    mha = layers * heads * (int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim)
                            + int(cfg.v_head_dim)) * elem
    return record(
        "kv_bytes", "shoal", **bench.common(), source=source, engine_error=bench.build_error,
        kv_cache_shape_and_layers=shapes, kv_cache_slots=slots,
        kv_cache_gib=per_token * slots / 2**30 if slots else None,
        num_layers=layers, latent_row=latent_dim, element_bytes=elem,
        kv_bytes_per_token=per_token, kv_bytes_per_token_from_config=expected,
        matches_config=per_token == expected,
        gqa_kv_bytes_per_token=gqa,
        gqa_shape=f"{layers} layers x 2 planes x {heads} heads x {head_dim} x {elem} B",
        ratio_vs_gqa=per_token / gqa, gqa_over_mla=gqa / per_token,
        mha_kv_bytes_per_token=mha,
        mha_shape=(f"{layers} layers x {heads} heads x (K {cfg.qk_nope_head_dim}+"
                   f"{cfg.qk_rope_head_dim} + V {cfg.v_head_dim}) x {elem} B"),
        ratio_vs_mha=per_token / mha, mha_over_mla=mha / per_token)


def mla_kernel(bench: Bench) -> dict[str, Any]:
    if not MLA_SCRIPT.exists():
        return record("mla_kernel", "shoal", skipped=f"{MLA_SCRIPT.name} not found")
    with tempfile.TemporaryDirectory(prefix="deepseek-mla-") as tmp:
        out = Path(tmp) / "mla.json"
        cmd = [sys.executable, str(MLA_SCRIPT), "--out", str(out)]
        env = dict(os.environ)
        if bench.args.smoke:
            cmd.append("--smoke")
            env["TRITON_INTERPRET"] = "1"  # its Triton kernel on CPU tensors
        elif bench.args.mla_heads:
            cmd += ["--heads", bench.args.mla_heads]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=bench.args.mla_timeout)
        wall = time.perf_counter() - t0
        print(proc.stdout[-4000:], proc.stderr[-4000:] if proc.returncode else "", flush=True)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{MLA_SCRIPT.name} exited {proc.returncode}: "
                               f"{proc.stderr.strip().splitlines()[-1:]} ")
        rows = json.loads(out.read_text())
    keep = ("heads", "batch", "context", "dtype", "absorbed_ms", "kernel_ms", "kernel_tbps",
            "kernel_fraction_of_h200_bw", "expanded_ms", "speedup_absorbed_vs_expanded",
            "max_abs_err", "kv_bytes_per_token_latent", "kv_bytes_per_token_expanded",
            "timing", "expanded_skipped")
    cases = [{k: r[k] for k in keep if k in r} for r in rows]
    return record("mla_kernel", "shoal", smoke=bench.args.smoke, command_run=" ".join(cmd[1:]),
                  wall_s=wall, num_cases=len(cases),
                  median_kernel_ms=statistics.median(c["kernel_ms"] for c in cases)
                  if cases else None, cases=cases)


PARTS = {"batch1": batch1, "w1": w1, "kv": kv_bytes, "mla": mla_kernel}
# mla first: its subprocess has the GPU to itself before the engine takes ~90% of it.
ALL = ["mla", "kv", "batch1", "w1"]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", type=comma_words, help=f"all, or a comma list of {', '.join(PARTS)}")
    add_common(ap, out=REQUIRED, num_requests=None, max_num_seqs=256,
               smoke="CPU, float32, a tiny DeepSeek-V2 config in a temp folder")
    ap.add_argument("--model", default=None,
                    help=f"model name or folder (default {MODEL}; --smoke: a tiny config)")
    ap.add_argument("--mla-heads", default="16",
                    help="mla part: --heads for mla_decode_gpu.py ('16,128' adds V3's)")
    ap.add_argument("--mla-timeout", type=float, default=180)
    args = ap.parse_args(argv)
    parts = ALL if args.part == ["all"] else args.part
    if unknown := [p for p in parts if p not in PARTS]:
        ap.error(f"unknown part(s) {unknown}: all, or {', '.join(PARTS)}")
    sizes = dict(SMOKE if args.smoke else FULL)
    tmp = None
    if args.smoke and args.model is None:
        tmp = tempfile.TemporaryDirectory(prefix="deepseek-smoke-")
        args.model = str(write_smoke_config(Path(tmp.name) / "tiny-deepseek-v2"))
    args.model = args.model or MODEL
    if args.smoke:
        args.max_num_seqs = min(args.max_num_seqs, 8)
    bench = Bench(args, sizes)
    records: list[dict[str, Any]] = []
    for name in parts:
        t0 = time.perf_counter()
        try:
            rec = PARTS[name](bench)
        except Exception as e:  # one part's failure must not hide the others
            traceback.print_exc()
            rec = record({"kv": "kv_bytes", "mla": "mla_kernel"}.get(name, name), "shoal",
                         model=args.model, error=f"{type(e).__name__}: {e}",
                         traceback=traceback.format_exc()[-3000:])
        rec["part_wall_s"] = time.perf_counter() - t0
        records.append(rec)
        print(json.dumps(rec, default=str), flush=True)
        write(records, args.out)
    bench.close()
    if tmp is not None:
        tmp.cleanup()
    return records


if __name__ == "__main__":
    # Exit status 1 when a part failed (its record holds the error); the file has them all.
    sys.exit(1 if any("error" in r for r in main()) else 0)
