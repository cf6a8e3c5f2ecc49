"""GPT-OSS-20B on one GPU (written for an H100/H200): batch-1 decode against its active-weight
read floor and W1-style throughput, on random weights of the shipped shape
(shoal/model_configs/gpt-oss-20b, load_format="dummy"). Its quantization_config says MXFP4,
so on CUDA the experts are built packed (random e2m1 codes and e8m0 scales, the dense stacks
never allocated) and run by the MXFP4 Triton kernel; attention, router, embedding and LM head
are bf16.

    python benchmarks/gpt_oss_gpu.py all --out bench-work/gptoss-h100.json
    python benchmarks/gpt_oss_gpu.py batch1 | w1 --out FILE
    python benchmarks/gpt_oss_gpu.py all --smoke --out /tmp/gptoss.json   # CPU, tiny config

Parts (one JSON record each, all written to --out after every part; one engine for both):

- batch1: offline_runs.batch1 (128 random prompt ids, 256 output tokens, greedy, ignore_eos,
  median of 3, a fresh prompt each run) and the floor: the bytes one decode token reads at
  batch 1 over offline_runs.copy_bandwidth() (H200 4.25, H100 3.0 TB/s). Per layer: attention
  (q/k/v/o weights and biases, sinks), the two norms and the router (weight and bias) in bf16,
  and num_experts_per_tok experts (at batch 1 a token runs exactly that many), each its
  gate_up and down weights in MXFP4 (half a byte a weight plus a one-byte scale per 32) and
  its biases in bf16; then one embedding row, the final norm and the whole LM head (the
  logits read every vocabulary row). KV reads are left out of the floor (given beside it at
  the run's mean context).
- w1: 256 requests as gpu_suite's W1 (random ids below 10,000, inputs and outputs
  U[100, 1024], temperature 0.6, ignore_eos), max_num_seqs 256, max_model_len 4096.

Every record names the commit (SHOAL_COMMIT, else git) and the GPU, and where the engine's
internals are reachable (not under SHOAL_BENCH_PUBLIC_ONLY=1) the form the experts ended in
(e.g. {"Mxfp4Experts": 24}: a dense entry means the packed path did not run) and the bytes of
the loaded weights, with the packed bytes of one expert against the floor's figure.

--smoke: a tiny gpt-oss config (quantization_config mxfp4) on the CPU in float32, small
request counts; the MXFP4 kernel is CUDA-only, so its experts are unpacked into dense stacks
there: it checks the script, not the speed."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import engine_internals
import offline_runs
from bench_args import REQUIRED, add_common, comma_words
from offline_runs import copy_bandwidth
from results_file import record, shoal_source, write

MODEL = "openai/gpt-oss-20b"
SHIPPED = "gpt-oss-20b"  # its folder under shoal/model_configs
MXFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 32  # e2m1 codes, one e8m0 scale per 32 values

SMOKE_CONFIG: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 512,
    "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_local_experts": 4, "num_experts_per_tok": 2, "experts_per_token": 2,
    "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
    "attention_bias": True, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0, "rope_scaling": {
        "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 64},
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32", "quantization_config": {"quant_method": "mxfp4"}}

FULL = dict(dtype="bfloat16", max_model_len=4096, b1_in=128, b1_out=256, w1_in=(100, 1024),
            w1_out=(100, 1024), num_requests=256, max_num_seqs=256, kv_cache_memory_bytes=None)
SMOKE = dict(dtype="float32", max_model_len=256, b1_in=16, b1_out=12, w1_in=(8, 40),
             w1_out=(4, 16), num_requests=6, max_num_seqs=8, kv_cache_memory_bytes=32 << 20)


def active_bytes(cfg: dict[str, Any], dense_bytes: int = 2) -> dict[str, Any]:
    """The bytes one batch-1 decode token reads (the module docstring's rule), by part."""
    h, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    heads, kv = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    hd = int(cfg.get("head_dim") or h // heads)
    inter, experts = int(cfg["intermediate_size"]), int(cfg["num_local_experts"])
    k = int(cfg.get("num_experts_per_tok") or cfg["experts_per_token"])
    q, kv_dim = heads * hd, kv * hd
    bias = bool(cfg.get("attention_bias", True))
    attention = layers * (h * (q + 2 * kv_dim) + q * h + heads
                          + ((q + 2 * kv_dim + h) if bias else 0)) * dense_bytes
    norms = (2 * layers + 1) * h * dense_bytes
    router = layers * (experts * h + experts) * dense_bytes
    per_expert = (2 * inter * h + h * inter) * MXFP4_BYTES_PER_WEIGHT \
        + (2 * inter + h) * dense_bytes
    parts = dict(attention=attention, norms=norms, router=router,
                 active_experts=layers * k * per_expert, embedding_row=h * dense_bytes,
                 lm_head=int(cfg["vocab_size"]) * h * dense_bytes)
    return dict(bytes_per_token=sum(parts.values()), bytes_by_part=parts,
                expert_bytes_each=per_expert, experts_per_token=k, layers=layers)


def floor(cfg: dict[str, Any], dense_bytes: int, decode: float | None,
          mean_context: float) -> dict[str, Any]:
    b = active_bytes(cfg, dense_bytes)
    bandwidth = copy_bandwidth()
    roof = bandwidth / b["bytes_per_token"]
    kv_dim = int(cfg["num_key_value_heads"]) * int(
        cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    window = int(cfg.get("sliding_window") or 0)
    kinds = cfg.get("layer_types") or ["full_attention"] * b["layers"]
    rows = sum(min(mean_context, window) if t == "sliding_attention" and window else
               mean_context for t in kinds)
    return dict(weight_bytes_per_token=b["bytes_per_token"], weight_bytes_by_part=b[
        "bytes_by_part"], floor_expert_bytes_each=b["expert_bytes_each"],
                copy_bandwidth=bandwidth, floor_tok_s=roof,
                fraction_of_floor=decode / roof if decode else None,
                kv_bytes_read_per_token_at_mean_context=int(2 * kv_dim * dense_bytes * rows),
                floor_rule="(attention + norms + router + experts_per_token x one MXFP4 "
                           "expert + one embedding row + LM head) per token / copy bandwidth; "
                           "KV reads not included")


def loaded_weights(llm: Any) -> dict[str, Any]:
    """The experts' form and the weights' bytes in the engine's model (internals: None under
    SHOAL_BENCH_PUBLIC_ONLY=1)."""
    model = getattr(engine_internals.runner(llm), "model", None)
    if model is None:
        return dict(experts_form=None, model_weight_bytes=None, model_expert_bytes_each=None)
    forms: dict[str, int] = {}
    each = None
    for m in model.modules():
        if hasattr(m, "install_mxfp4"):  # a FusedMoE
            quant = getattr(m, "quant", None)
            name = type(quant).__name__ if quant is not None else "dense"
            forms[name] = forms.get(name, 0) + 1
            if quant is not None and each is None:
                each = quant.nbytes / m.local_num_experts + sum(
                    t[0].numel() * t.element_size() for t in (m.w13_bias, m.w2_bias)
                    if t is not None)
    tensors = [*model.parameters(), *model.buffers()]
    return dict(experts_form=forms, model_expert_bytes_each=each,
                model_weight_bytes=sum(t.numel() * t.element_size() for t in tensors))


class Bench:
    """The one engine both parts share, built on first use."""

    def __init__(self, args: argparse.Namespace, sizes: dict[str, Any], folder: Path):
        self.args, self.sizes, self.folder = args, sizes, folder
        self.cfg = json.loads((folder / "config.json").read_text())
        self._engine: offline_runs.Engine | None = None

    @property
    def llm(self) -> Any:
        if self._engine is None:
            s = self.sizes
            kw: dict[str, Any] = dict(load_format="dummy", dtype=s["dtype"],
                                      max_model_len=s["max_model_len"],
                                      max_num_seqs=s["max_num_seqs"])
            if s["kv_cache_memory_bytes"] is not None:
                kw |= {"kv_cache_memory_bytes": s["kv_cache_memory_bytes"], "device": "cpu"}
            self._engine = offline_runs.start_engine(str(self.folder), **kw)
        return self._engine.llm

    def common(self) -> dict[str, Any]:
        import torch

        eng = self._engine
        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        return dict(model=self.args.model, config_folder=str(self.folder), gpu=gpu,
                    dtype=self.sizes["dtype"], smoke=self.args.smoke,
                    ready_s=eng.ready_s if eng else None,
                    process_ready_s=eng.process_ready_s if eng else None,
                    max_model_len=self.sizes["max_model_len"],
                    max_num_seqs=self.sizes["max_num_seqs"], **loaded_weights(self.llm))

    def close(self) -> None:
        if self._engine is not None:
            self._engine.llm.shutdown()
            self._engine = None


def batch1(bench: Bench) -> dict[str, Any]:
    s = bench.sizes
    fig = offline_runs.batch1(bench.llm, int(bench.cfg["vocab_size"]), s["b1_in"],
                              s["b1_out"])
    dense_bytes = 2 if s["dtype"] in ("bfloat16", "float16") else 4
    return record("gptoss_batch1", "shoal", **bench.common(), batch=1, input_len=s["b1_in"],
                  output_len=s["b1_out"], **fig,
                  **floor(bench.cfg, dense_bytes, fig["decode_tok_s"],
                          s["b1_in"] + s["b1_out"] / 2),
                  graph_replay_ms=engine_internals.graph_replay_ms(bench.llm))


def w1(bench: Bench) -> dict[str, Any]:
    s = bench.sizes
    n = bench.args.num_requests or s["num_requests"]
    prompts, params, ins, outs = offline_runs.w1_requests(
        n, min(10000, int(bench.cfg["vocab_size"])), in_range=s["w1_in"],
        out_range=s["w1_out"])
    fig = offline_runs.throughput(bench.llm, prompts, params)
    return record("gptoss_w1", "shoal", **bench.common(), num_requests=n,
                  input_len_range=list(s["w1_in"]), output_len_range=list(s["w1_out"]),
                  total_input_tokens=sum(ins), expected_output_tokens=sum(outs),
                  temperature=0.6, **fig)


PARTS = {"batch1": batch1, "w1": w1}


def shipped_config_folder() -> Path:
    tree = shoal_source()
    if tree is None:
        raise RuntimeError("shoal is not importable: no shipped gpt-oss-20b config")
    return Path(tree, "shoal", "model_configs", SHIPPED)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", type=comma_words, help=f"all, or a comma list of {', '.join(PARTS)}")
    add_common(ap, out=REQUIRED, num_requests=None,
               smoke="CPU, float32, a tiny gpt-oss config in a temp folder")
    ap.add_argument("--model", default=None,
                    help=f"a gpt-oss config folder (default: the shipped {MODEL} shape)")
    args = ap.parse_args(argv)
    parts = list(PARTS) if args.part == ["all"] else args.part
    if unknown := [p for p in parts if p not in PARTS]:
        ap.error(f"unknown part(s) {unknown}: all, or {', '.join(PARTS)}")
    sizes = dict(SMOKE if args.smoke else FULL)
    tmp = None
    if args.model is not None:
        folder = Path(args.model)
    elif args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="gptoss-smoke-")
        folder = Path(tmp.name)
        (folder / "config.json").write_text(json.dumps(SMOKE_CONFIG, indent=2) + "\n")
    else:
        folder = shipped_config_folder()
    args.model = args.model or (f"{MODEL} (smoke config)" if args.smoke else MODEL)
    bench = Bench(args, sizes, folder)
    records: list[dict[str, Any]] = []
    for name in parts:
        t0 = time.perf_counter()
        try:
            rec = PARTS[name](bench)
        except Exception as e:  # one part's failure must not hide the other's
            traceback.print_exc()
            rec = record(f"gptoss_{name}", "shoal", model=args.model,
                         error=f"{type(e).__name__}: {e}",
                         traceback=traceback.format_exc()[-3000:])
        rec["part_wall_s"] = time.perf_counter() - t0
        records.append(rec)
        print(json.dumps({k: v for k, v in rec.items()
                          if k not in ("host", "versions", "traceback")}, default=str),
              flush=True)
        write(records, args.out)
    bench.close()
    if tmp is not None:
        tmp.cleanup()
    return records


if __name__ == "__main__":
    # Exit status 1 when a part failed (its record holds the error); the file has them all.
    sys.exit(1 if any("error" in r for r in main()) else 0)
