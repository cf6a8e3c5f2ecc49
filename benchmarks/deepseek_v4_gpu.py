"""DeepSeek-V4 on one GPU (written for an H200; the shape fits an 80 GB H100 too): greedy
agreement with transformers 5.25 at the real width, batch-1 decode against the active-weight
read floor, W1-style throughput, and decode step time at 1k / 32k / 128k tokens of context
against DeepSeek-V3's dense latent attention (MLA) at the same width, with the KV bytes a
token of context costs in each. Engine parts run the shipped shape
deepseek-ai/DeepSeek-V4-Flash-Base-4layers (shoal/model_configs/, 27.39B parameters, 51 GiB
in bf16) on random weights (load_format="dummy"): prompts are token ids.

    python benchmarks/deepseek_v4_gpu.py all --out bench-work/v4-h200.json
    python benchmarks/deepseek_v4_gpu.py correctness,batch1,w1,long_context,kv --out FILE \
        [--num-requests N] [--contexts 1024,32768] [--dtype float32]
    python benchmarks/deepseek_v4_gpu.py all --smoke --out /tmp/v4.json   # CPU, tiny configs

Parts (one JSON record each, the file rewritten after every one):

- correctness: transformers' DeepseekV4ForCausalLM at the cut's width and layers (sliding,
  sliding, CSA, HCA; hash then top-k routing) but CORRECTNESS_EXPERTS routed experts (the
  attention, compressors, indexer and hyper-connections are the real ones; the expert count
  only sizes the MoE), random weights as benchmarks/hf_agreement.py draws them (matrices
  N(0, 0.2 * min(1, sqrt(64 / fan_in))), vectors U(0.5, 1.5)), each hash layer's token -> experts
  table k distinct experts per token, the routing bias N(0, 0.5), in the engine dtype on the
  device; save_pretrained, loaded by shoal. Prompts of 48, 400 and 2300 random ids (past the
  window of 128, the HCA group of 128 and index_topk x m = 2048 tokens, where the indexer
  starts to leave entries out), 12 greedy tokens each against transformers' full forward
  re-run for every token (its cached generation drifts from it at tied indexer scores:
  tests/models/test_deepseek_v4.py). Token agreement, the largest |logprob difference| over
  each prompt's agreeing prefix, the first divergence and transformers' margin there (bf16
  near-ties diverge: reported, not failed; --dtype float32 gives the tight check).
- kv_bytes: from the engine's cache specs (runner.kv_specs): what a token of context costs
  (kv_cache_spec.context_bytes_per_token: CSA entries, 1 per 4 tokens with the indexer's key;
  HCA entries, 1 per 128) and the per-request bounded rows (every layer's window of 128 rows,
  the compressors' open groups), against MLA's latent row per layer (layers x (kv_lora_rank +
  qk_rope_head_dim) x 2 B).
- batch1: 128 prompt ids, 256 output tokens, greedy, median of 3 (offline_runs.batch1). Floor:
  active parameters x 2 B / the GPU's copy bandwidth (deepseek_gpu.count_active: the routed
  experts replaced by top-k of them per MoE layer, hash layers included).
- long_context: for contexts 1k, 32k, 128k (--contexts), one request prefilled to that length
  (chunks of 8192 tokens) then 32 greedy tokens: prefill (TTFT) and decode ms per token from
  RequestOutput.metrics, and the bytes the sequence holds (exact: context bytes x tokens + its
  bounded rows). The same in the MLA engine (stage mla: DeepseekV3ForCausalLM, every layer
  dense latent attention over every token, Triton kernels and decode CUDA graphs): V3's
  attention fields (kv_lora_rank 512, rope 64, nope 128, v 128, YaRN factor 40 over 4096) and
  routing (sigmoid, noaux_tc, 8 groups, top 4), as shoal/model_configs/deepseek-v3.2-exp-4layers
  ships them, at the cut's width: hidden, heads, q_lora_rank, vocabulary, layers and experts
  (256 of 2048, top 6, one shared) are V4's, every layer MoE. A long_context_summary record
  pairs the two per context.
- w1: deepseek_gpu's w1 (W1 requests: inputs and outputs U[100, 1024], temperature 0.6,
  max_num_seqs 256; --num-requests for fewer).

Both engines: max_model_len the largest context + decode + 128, kv_cache_memory_bytes 8 GiB
(V4's context costs 328 B a token, so a budget from free memory would make millions of blocks
for the scheduler), max_num_batched_tokens 8192. V4's decode steps replay CUDA graphs
(one per batch size and table width; its prefill chunks run eagerly); --enforce-eager makes
both engines eager.

Stages run in child processes (benchmarks/staged_gpu.py), each with --stage-timeout:
v4 (kv, batch1, long_context, w1), mla (long_context_mla), then correctness. On an H200,
estimated from the eager step's ~1,800 kernel launches (about 10-15 ms a decode step) and the
other GPU scripts' start-up times (not measured yet): v4 ~110 s (ready ~35 s, batch1 ~15 s,
long_context ~15 s, w1 ~40 s), mla ~60 s, correctness ~50 s. A child that dies or outlasts
its timeout leaves error records with its stderr tail; exit status 1 when any record has an
error. --no-isolate runs them in this process. --smoke writes tiny V4 and MLA configs (4
layers, hidden 64) to a temp folder and runs every part on the CPU in float32 at small
sizes."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import engine_internals
import offline_runs
import staged_gpu
from deepseek_gpu import w1, weight_floor
from hf_agreement import INIT_RULE, compare, correctness_device, hf_and_shoal, randomize
from long_context_runs import context_max_model_len, contexts_for, measure_contexts
from results_file import record, shoal_source, write
from staged_gpu import LazyEngine, append, engine_kw, free_memory, read_records

MODEL = "deepseek-ai/DeepSeek-V4-Flash-Base-4layers"
CONFIG_FOLDER = "deepseek-v4-flash-base-4layers"
MLA_BASE_FOLDER = "deepseek-v3.2-exp-4layers"  # V3's attention and routing fields
CORRECTNESS_EXPERTS = 8
PARTS = ("correctness", "kv", "batch1", "long_context", "w1")
# (stage, its parts), each one child process; the mla stage writes long_context_mla
STAGES = (("v4", ("kv", "batch1", "long_context", "w1")), ("mla", ("long_context",)),
          ("correctness", ("correctness",)))
WORKLOADS = {"kv": "kv_bytes"}
MLA_WORKLOAD = "long_context_mla"

FULL = dict(dtype="bfloat16", b1_in=128, b1_out=256, w1_in=(100, 1024), w1_out=(100, 1024),
            num_requests=256, kv_cache_memory_bytes=8 << 30, contexts=[1024, 32768, 131072],
            decode_tokens=32, max_num_batched_tokens=8192, max_model_len=None,
            corr_lens=(48, 400, 2300), corr_steps=12, corr_max_model_len=4096,
            corr_kv_bytes=2 << 30, device=None)
SMOKE = dict(dtype="float32", b1_in=16, b1_out=12, w1_in=(8, 40), w1_out=(4, 16),
             num_requests=6, kv_cache_memory_bytes=32 << 20, contexts=[64, 256, 480],
             decode_tokens=8, max_num_batched_tokens=128, max_model_len=512,
             corr_lens=(20, 70, 137), corr_steps=8, corr_max_model_len=512,
             corr_kv_bytes=32 << 20, device="cpu")

# ---- the tiny configs of --smoke (the cut's structure at toy sizes) -------------------------
SMOKE_V4: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 512, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "q_lora_rank": 32,
    "partial_rotary_factor": 0.5, "num_experts_per_tok": 2, "n_routed_experts": 8,
    "n_shared_experts": 1, "hc_mult": 3, "sliding_window": 8, "o_groups": 2, "o_lora_rank": 16,
    "index_n_heads": 16, "index_head_dim": 32, "index_topk": 4, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2,
    "layer_types": ["sliding_attention", "sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention"],
    "mlp_layer_types": ["hash_moe", "hash_moe", "hash_moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                        "original_max_position_embeddings": 128, "beta_fast": 32,
                        "beta_slow": 1}}
SMOKE_MLA_FIELDS: dict[str, Any] = {
    "kv_lora_rank": 32, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "n_group": 1, "topk_group": 1, "rope_scaling": None, "max_position_embeddings": 512}
# V3's fields kept from the base config; the rest of the MLA config is the cut's
MLA_FIELDS = ("attention_bias", "hidden_act", "kv_lora_rank", "qk_rope_head_dim",
              "qk_nope_head_dim", "v_head_dim", "n_group", "topk_group", "norm_topk_prob",
              "routed_scaling_factor", "rope_scaling", "rope_theta", "max_position_embeddings",
              "rms_norm_eps")


def v4_folder(args: argparse.Namespace) -> Path:
    """The V4 model folder: --model, else the shipped cut in the shoal tree `import shoal`
    loads (a data file, not an engine API)."""
    if args.model:
        return Path(args.model)
    return Path(shoal_source() or ".", "shoal", "model_configs", CONFIG_FOLDER)


def read_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def mla_config(v4: dict[str, Any], smoke: bool) -> dict[str, Any]:
    """DeepseekV3ForCausalLM at the V4 cut's width: V3's latent attention and routing fields
    (the shipped V3.2 cut's, its indexer left out), V4's width, layers and experts."""
    if smoke:
        base: dict[str, Any] = {"attention_bias": False, "hidden_act": "silu", "rope_theta":
                                10000, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
                                "rms_norm_eps": 1e-5, **SMOKE_MLA_FIELDS}
    else:
        folder = Path(shoal_source() or ".", "shoal", "model_configs", MLA_BASE_FOLDER)
        base = {k: v for k, v in read_config(folder).items() if k in MLA_FIELDS}
    heads = v4["num_attention_heads"]
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **base,
            "vocab_size": v4["vocab_size"], "hidden_size": v4["hidden_size"],
            "num_hidden_layers": v4["num_hidden_layers"], "num_attention_heads": heads,
            "num_key_value_heads": heads, "q_lora_rank": v4["q_lora_rank"],
            "n_routed_experts": v4["n_routed_experts"],
            "num_experts_per_tok": v4["num_experts_per_tok"],
            "moe_intermediate_size": v4["moe_intermediate_size"],
            "intermediate_size": v4["moe_intermediate_size"],  # (no dense layer reads it)
            "n_shared_experts": v4["n_shared_experts"], "first_k_dense_replace": 0,
            "moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
            "bos_token_id": v4["bos_token_id"], "eos_token_id": v4["eos_token_id"],
            "tie_word_embeddings": False}


def mla_bytes_per_token(cfg: dict[str, Any], elem: int) -> int:
    return cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * elem


# ---- engines -------------------------------------------------------------------------------

def max_model_len(args: argparse.Namespace, sizes: dict[str, Any], cfg: dict[str, Any]) -> int:
    return context_max_model_len(args, sizes, cfg.get("max_position_embeddings"))


class EngineStage(LazyEngine):
    """The V4 cut on one engine (built on first use) for kv, batch1, long_context, w1."""

    def __init__(self, args: argparse.Namespace, sizes: dict[str, Any]):
        self.args, self.sizes = args, sizes
        folder = v4_folder(args)
        self.cfg = read_config(folder)
        self.max_model_len = max_model_len(args, sizes, self.cfg)
        super().__init__(str(folder), engine_kw(args, sizes, self.max_model_len))

    def vocab(self) -> int:
        return int(self.cfg["vocab_size"])

    def common(self) -> dict[str, Any]:
        return dict(model=MODEL if not self.args.model else self.args.model,
                    dtype=self.sizes["dtype"], smoke=self.args.smoke, **self.ready_fields(),
                    max_num_seqs=self.args.max_num_seqs, max_model_len=self.max_model_len,
                    kv_cache_memory_bytes=self.sizes["kv_cache_memory_bytes"],
                    enforce_eager=engine_eager(self._engine),
                    max_num_batched_tokens=self.args.max_num_batched_tokens
                    or self.sizes["max_num_batched_tokens"])


def engine_eager(eng: offline_runs.Engine | None) -> bool | None:
    """Whether the engine runs without CUDA graphs, as its config resolved it (an internal)."""
    core = engine_internals.core(eng.llm) if eng is not None else None
    return getattr(getattr(core, "config", None), "enforce_eager", None)


def v4_layout(llm: Any) -> dict[str, Any] | None:
    """What the engine's caches cost (its cache specs: an internal; None without them)."""
    from shoal.core.kv_cache_spec import context_bytes_per_token

    run = engine_internals.runner(llm)
    specs, groups = getattr(run, "kv_specs", None), getattr(run, "kv_groups", None)
    if not specs or not groups:
        return None
    bs = int(run.block_size)
    bounded = [(type(s).__name__, s.sliding_window, s.page_bytes(bs) // bs)
               for s in specs if s.drops_blocks]
    kept = [(type(s).__name__, getattr(s, "ratio", 1), s.bytes_per_token(bs))
            for s in specs if not s.drops_blocks]
    return dict(block_size=bs, context_bytes_per_token=context_bytes_per_token(specs, bs),
                bounded_rows=[dict(kind=k, window=w, row_bytes=b) for k, w, b in bounded],
                context_layers=[dict(kind=k, ratio=r, bytes_per_token=b) for k, r, b in kept],
                bounded_bytes_per_request=sum(w * b for _, w, b in bounded),
                group_blocks=[g.num_blocks for g in groups],
                source="runner kv_specs / kv_groups")


def v4_seq_bytes(lay: dict[str, Any], tokens: int) -> int:
    """Bytes one sequence of `tokens` holds: its context's, and its windows' rows (at most
    each window)."""
    rows = sum(min(tokens, r["window"]) * r["row_bytes"] for r in lay["bounded_rows"])
    return int(lay["context_bytes_per_token"] * tokens + rows)


def kv_bytes(st: EngineStage) -> dict[str, Any]:
    lay = v4_layout(st.llm)
    elem = 2 if st.sizes["dtype"] == "bfloat16" else 4
    mla = mla_bytes_per_token(mla_config(st.cfg, st.args.smoke), elem)
    out = dict(layout=lay, mla_bytes_per_token=mla,
               mla_rule="layers x (kv_lora_rank + qk_rope_head_dim) x element bytes")
    if lay:
        out |= dict(context_bytes_per_token=lay["context_bytes_per_token"],
                    mla_over_v4_per_token=mla / lay["context_bytes_per_token"],
                    at_contexts=[dict(context=c, v4_bytes=v4_seq_bytes(lay, c),
                                      mla_bytes=mla * c,
                                      mla_over_v4=mla * c / v4_seq_bytes(lay, c))
                                 for c in contexts_for(st.args, st.sizes)])
    return record("kv_bytes", "shoal", **st.common(), **out)


def roofline(st: EngineStage, decode: float) -> dict[str, Any]:
    model = getattr(engine_internals.runner(st.llm), "model", None)
    if model is None:
        return dict(roofline_tok_s=None, params=None)
    return dict(**weight_floor(model, int(st.cfg["num_experts_per_tok"]), decode),
                active_params_rule=(
                    "deepseek_gpu.count_active: all parameters minus the routed experts' "
                    "stacked w13/w2, plus num_experts_per_tok x one expert per MoE layer (hash "
                    "and top-k routed alike); shared expert, attention, compressors, indexer "
                    "and hyper-connections in full"))


def batch1(st: EngineStage) -> dict[str, Any]:
    s = st.sizes
    fig = offline_runs.batch1(st.llm, st.vocab(), s["b1_in"], s["b1_out"])
    return record("batch1", "shoal", **st.common(), batch=1, input_len=s["b1_in"],
                  output_len=s["b1_out"], **fig, **roofline(st, fig["decode_tok_s"] or 0))


def long_context(st: EngineStage) -> dict[str, Any]:
    lay = v4_layout(st.llm)
    elem = 2 if st.sizes["dtype"] == "bfloat16" else 4
    per_token = mla_bytes_per_token(mla_config(st.cfg, st.args.smoke), elem)

    def seq_bytes(c: int) -> dict[str, Any]:
        return dict(kv_bytes=v4_seq_bytes(lay, c) if lay else None)

    rows = measure_contexts(st.llm, contexts_for(st.args, st.sizes), st.max_model_len,
                            st.sizes, st.vocab(), st.args.seed, seq_bytes)
    for r in rows:
        r["mla_kv_bytes"] = per_token * r["context"]
    return record("long_context", "shoal", **st.common(), layout=lay, contexts=rows,
                  bytes_rule="kv_bytes: context_bytes_per_token x tokens + each window's "
                  "rows (at most the window); mla_kv_bytes: layers x latent row x tokens")


def long_context_mla(args: argparse.Namespace, sizes: dict[str, Any]) -> dict[str, Any]:
    """The MLA engine at the cut's width: the same requests as long_context."""
    raw = mla_config(read_config(v4_folder(args)), args.smoke)
    return mla_contexts(args, sizes, raw, "DeepseekV3ForCausalLM at the V4 cut's width")


def mla_contexts(args: argparse.Namespace, sizes: dict[str, Any], raw: dict[str, Any],
                 label: str, **engine_over: Any) -> dict[str, Any]:
    """long_context's requests on an engine of the MLA config `raw` (written to a temp
    folder; engine_over: engine arguments over engine_kw's). deepseek_v32_gpu.py uses it too."""
    elem = 2 if sizes["dtype"] == "bfloat16" else 4
    per_token = mla_bytes_per_token(raw, elem)
    limit = max_model_len(args, sizes, raw)
    tmp = tempfile.mkdtemp(prefix="mla-")
    eng = None
    try:
        (Path(tmp) / "config.json").write_text(json.dumps(raw, indent=2))
        kw = engine_kw(args, sizes, limit) | engine_over
        eng = offline_runs.start_engine(tmp, **kw)
        caches = getattr(engine_internals.runner(eng.llm), "kv_caches", None)
        engine_per_token = (sum(kv.numel() // kv.shape[1] * kv.element_size() for kv in caches)
                            if caches else None)
        rows = measure_contexts(eng.llm, contexts_for(args, sizes), limit, sizes,
                                int(raw["vocab_size"]), args.seed,
                                lambda c: dict(kv_bytes=(engine_per_token or per_token) * c))
        return record(MLA_WORKLOAD, "shoal", model=label,
                      config=raw, dtype=sizes["dtype"], smoke=args.smoke, ready_s=eng.ready_s,
                      max_model_len=limit, max_num_seqs=kw["max_num_seqs"],
                      enforce_eager=engine_eager(eng),
                      kv_bytes_per_token=engine_per_token, kv_bytes_per_token_config=per_token,
                      contexts=rows)
    finally:
        if eng is not None:
            eng.llm.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        free_memory()


# ---- correctness ---------------------------------------------------------------------------

def randomize_v4(model: Any, seed: int) -> None:
    """hf_agreement's draw, each hash layer's token -> experts table k distinct experts per
    token, the routing bias N(0, 0.5)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    randomize(model)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                experts = model.config.n_routed_experts
                picks = torch.rand(b.shape[0], experts, generator=gen).argsort(dim=-1)
                b.copy_(picks[:, :b.shape[1]].to(b.device))
            elif name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.5)


def hf_full_greedy(hf: Any, prompt: list[int], steps: int, device: str
                   ) -> tuple[list[int], list[Any]]:
    """transformers' greedy tokens and log-probabilities, its full forward re-run for every
    token (no cache)."""
    import torch

    ids, out, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            last = hf(torch.tensor([ids], device=device), use_cache=False).logits[0, -1].float()
            logprobs.append(torch.log_softmax(last, -1).cpu())
            out.append(int(last.argmax()))
            ids.append(out[-1])
    return out, logprobs


def correctness(args: argparse.Namespace, sizes: dict[str, Any]) -> dict[str, Any]:
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = read_config(v4_folder(args))
    raw = {**raw, "n_routed_experts": min(raw["n_routed_experts"], CORRECTNESS_EXPERTS)}
    base = dict(model=MODEL, dtype=sizes["dtype"], smoke=args.smoke,
                layer_types=raw["layer_types"], hidden_size=raw["hidden_size"],
                n_routed_experts=raw["n_routed_experts"])
    try:
        kw = {k: v for k, v in raw.items() if k not in ("model_type", "architectures")}
        cfg = AutoConfig.for_model(raw["model_type"], **kw)
    except Exception as e:
        return record("correctness", "shoal", **base, skipped=(
            f"transformers {transformers.__version__} has no DeepSeek-V4 config "
            f"({type(e).__name__}: {e})"))
    device = correctness_device(args.smoke)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in sizes["corr_lens"]]
    with hf_and_shoal(lambda dtype: AutoModelForCausalLM.from_config(cfg, dtype=dtype),
                      lambda hf: randomize_v4(hf, args.seed), sizes, device, args.seed,
                      "v4-correctness-") as pair:
        return record("correctness", "shoal", **base,
                      **compare(pair.llm, pair.hf, prompts, sizes["corr_steps"], device,
                                hf_full_greedy),
                      hf_params=sum(p.numel() for p in pair.hf.parameters()),
                      hf_build_save_s=pair.build_save_s, shoal_ready_s=pair.shoal_ready_s,
                      oracle="transformers' full forward re-run for every token",
                      init_rule=(f"{INIT_RULE}, tid2eid k distinct experts a token, "
                                 "e_score_correction_bias N(0, 0.5)"),
                      note="bf16 near-ties diverge: reported, not failed")


# ---- stages and the child processes --------------------------------------------------------

def run_stage(args: argparse.Namespace, sizes: dict[str, Any], stage: str,
              parts: list[str]) -> None:
    """The stage's parts, each record appended to --out as it comes."""
    if stage == "correctness":
        staged_gpu.run_part(args.out, "correctness", MODEL, correctness, args, sizes)
    elif stage == "mla":
        staged_gpu.run_part(args.out, MLA_WORKLOAD, MODEL, long_context_mla, args, sizes)
    else:
        fns = {"kv": kv_bytes, "batch1": batch1, "long_context": long_context, "w1": w1}
        staged_gpu.run_engine_parts(args.out, MODEL, lambda: EngineStage(args, sizes),
                                    [(WORKLOADS.get(p, p), fns[p]) for p in parts])


def run_child(args: argparse.Namespace, stage: str, parts: list[str]) -> None:
    """run_stage in a child process; a child that dies leaves error records."""
    wanted = [MLA_WORKLOAD] if stage == "mla" else [WORKLOADS.get(p, p) for p in parts]
    staged_gpu.run_child(args, __file__, stage, parts, workloads=wanted, model=MODEL,
                         extra=["--model", args.model] if args.model else [])


def summary(path: Path) -> dict[str, Any] | None:
    """V4 against MLA, context by context, from the two long-context records."""
    recs = {r.get("workload"): r for r in read_records(path)}
    v4, mla = recs.get("long_context"), recs.get(MLA_WORKLOAD)
    if not v4 or "contexts" not in v4:
        return None
    by_ctx = {r["context"]: r for r in (mla or {}).get("contexts", [])}
    rows = []
    for h in v4["contexts"]:
        f = by_ctx.get(h["context"], {})
        vd, md = h.get("decode_ms_per_token"), f.get("decode_ms_per_token")
        vb, mb = h.get("kv_bytes"), f.get("kv_bytes") or h.get("mla_kv_bytes")
        rows.append(dict(context=h["context"], v4_decode_ms=vd, mla_decode_ms=md,
                         v4_over_mla_decode=vd / md if vd and md else None,
                         v4_prefill_s=h.get("prefill_s"), mla_prefill_s=f.get("prefill_s"),
                         v4_kv_bytes=vb, mla_kv_bytes=mb,
                         mla_over_v4_bytes=mb / vb if vb and mb else None))
    return record("long_context_summary", "shoal", model=MODEL, smoke=v4.get("smoke"),
                  v4_enforce_eager=v4.get("enforce_eager"),
                  mla_enforce_eager=(mla or {}).get("enforce_eager"), contexts=rows)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = staged_gpu.staged_parser(
        __doc__.split("\n\n")[0], PARTS, STAGES, stage_timeout=600,
        smoke="CPU, float32, tiny V4 and MLA configs in a temp folder",
        enforce_eager="both engines without CUDA graphs")
    ap.add_argument("--model", default=None,
                    help=f"a V4 model folder (default: the shipped {MODEL})")
    args, parts, sizes = staged_gpu.parse_staged(ap, argv, PARTS, FULL, SMOKE)
    if args.stage:  # a child: one stage
        run_stage(args, sizes, args.stage, parts)
        return read_records(args.out)
    tmp = staged_gpu.smoke_model(args, SMOKE_V4, "tiny-deepseek-v4")
    write([], args.out)
    staged_gpu.run_stages(args, STAGES, parts,
                          lambda stage, todo: run_stage(args, sizes, stage, todo),
                          lambda stage, todo: run_child(args, stage, todo))
    if "long_context" in parts and (rec := summary(args.out)) is not None:
        print(json.dumps(rec, default=str), flush=True)
        append(rec, args.out)
    if tmp is not None:
        tmp.cleanup()
    return read_records(args.out)


if __name__ == "__main__":
    # Exit status 1 when a part failed (its record holds the error); the file has them all.
    sys.exit(1 if any("error" in r for r in main()) else 0)
