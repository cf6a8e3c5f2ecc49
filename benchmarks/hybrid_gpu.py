"""Hybrid linear-attention models on one GPU (written for an H200): Qwen3-Next, Qwen3.5 (dense
and MoE, text only) and Kimi Linear. Greedy agreement with transformers on 4-layer random
checkpoints of the real width, batch-1 decode against the active-weight read floor, W1-style
throughput, and long-context decode with the KV + recurrent-state bytes a sequence holds,
against the same model with every layer full attention. Engine parts run the shipped shapes
(shoal/model_configs/) on random weights (load_format="dummy"): prompts are token ids.

    python benchmarks/hybrid_gpu.py all --out bench-work/hybrid-h200.json
    python benchmarks/hybrid_gpu.py correctness,batch1,w1,long_context --out FILE \
        [--models Qwen/Qwen3.5-27B,...] [--num-requests N] [--contexts 1024,32768]
    python benchmarks/hybrid_gpu.py all --smoke --out /tmp/hy.json   # CPU, tiny configs

Models (--models, comma list; default all four): Qwen/Qwen3-Next-80B-A3B-Instruct-24layers
(the 80B cut to 24 of its 48 layers: 80B in bf16 does not fit one H200), Qwen/Qwen3.5-27B,
Qwen/Qwen3.5-35B-A3B, moonshotai/Kimi-Linear-48B-A3B-Instruct. `all` on all four builds 12
engines and prefills 128k tokens 8 times: on a machine that limits one command's time, run one
model (or one part) per command, e.g. `--models Qwen/Qwen3.5-27B` or `long_context --models ...`.

Parts (one JSON record each per model, the file rewritten after every part):

- correctness: transformers' class for the family at the real hidden sizes but 4 layers (3
  linear + 1 full attention; Kimi: kda_layers [1, 2, 3], full_attn_layers [4]), random
  weights as tests/oracle.py write_tiny_checkpoint draws them (A_log ~ N(0, 0.3), dt_bias ~
  U(-4, -2), vectors U(0.5, 1.5)) with matrices N(0, 0.2 * sqrt(64 / fan_in)) for fan_in >
  64 (the tiny checkpoint's gain per matmul at hidden 64; 0.2 unscaled would blow up at real
  widths), in the engine dtype on the device; save_pretrained, loaded by shoal; 4 prompts of
  20-300 random ids, 16 greedy tokens each. Records the share of tokens equal to transformers'
  greedy, the largest |logprob difference| over each prompt's agreeing prefix (after a
  divergence the contexts differ), the first divergence step and transformers' own margin
  there (bf16 near-ties diverge: reported, not failed). A transformers without the family's
  class gives {"skipped": "transformers X has no class Y"}.
- batch1: 128 prompt ids, 256 output tokens, greedy, median of 3 (offline_runs.batch1, as
  deepseek_gpu). Floor: active parameters x 2 bytes / the GPU's copy bandwidth (deepseek_gpu.count_active:
  total minus the routed experts plus top-k experts per MoE layer; a dense model: all), and the
  floor with the attention KV at the mean context plus each linear layer's state read and
  written once per token.
- w1: deepseek_gpu's w1 (W1 requests, max_num_seqs 256; --num-requests for fewer).
- long_context: for contexts 1k, 32k, 128k (--contexts; capped by max_model_len), one request
  prefilled to that length (max_num_batched_tokens 8192: chunked) then ~32 greedy tokens:
  prefill (TTFT) and decode ms per token from RequestOutput.metrics. Bytes a sequence holds,
  from the engine's layout (runner kv_groups / kv_specs / kv_caches, engine_internals): exact
  (attention rows x tokens + every linear layer's state) and at block granularity (attention
  groups x ceil(tokens / block) blocks + one block per state group, x the bytes of a block id).
  Against the same width with every layer full attention (layer_types all "full_attention";
  Kimi: every layer MLA): layers x 2 x kv_heads x head_dim x 2 bytes a token (Kimi: layers x
  (kv_lora_rank + qk_rope_head_dim) x 2), and, in its own engine (decode CUDA graphs as the
  hybrid's; --enforce-eager: both eager), the same timings for every context whose KV fits next
  to its weights; the others are bytes only. A long_context_summary record pairs both.

Stages run in child processes, one per (model, stage): correctness (transformers + a small
engine), engine (batch1, w1, long_context on one engine, max_model_len the largest context +
decode + 128) and full (the all-full-attention engine). Each child's GPU memory comes back
when it exits; engines built in turn in one process may stay alive (the engine freezes its
start-up heap out of the garbage collector's reach). A child that dies or outlasts
--stage-timeout leaves an error record with its stderr tail; exit status 1 when any record
has an error. --no-isolate runs them all in
this process. --smoke writes tiny configs of the four families (4 layers, hidden 64) to a
temp folder and runs every part on the CPU in float32 with small sizes."""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import engine_internals
import long_context_runs
import offline_runs
import staged_gpu
from bench_args import comma_words
from deepseek_gpu import w1, weight_floor  # w1: the same W1 part on this EngineStage
from hf_agreement import compare, correctness_device, hf_and_shoal, randomize
from long_context_runs import context_max_model_len, contexts_for
from results_file import record, shoal_source, write
from staged_gpu import LazyEngine, append, engine_kw, free_memory, read_records

# Shipped shapes: name -> shoal/model_configs/<folder>.
CONFIG_FOLDERS = {
    "Qwen/Qwen3-Next-80B-A3B-Instruct-24layers": "qwen3-next-80b-a3b-24layers",
    "Qwen/Qwen3.5-27B": "qwen3.5-27b",
    "Qwen/Qwen3.5-35B-A3B": "qwen3.5-35b-a3b",
    "moonshotai/Kimi-Linear-48B-A3B-Instruct": "kimi-linear-48b-a3b",
    # (for an 80 GB card, where the whole model does not fit; not in the default list)
    "moonshotai/Kimi-Linear-48B-A3B-Instruct-16layers": "kimi-linear-48b-a3b-16layers",
    "Qwen/Qwen3-Next-80B-A3B-Instruct-16layers": "qwen3-next-80b-a3b-16layers",
}
MODELS = [m for m in CONFIG_FOLDERS if not m.endswith("-16layers")]
# transformers' class of each family (model_type -> class name).
HF_CLASSES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
              "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM", "kimi_linear": "KimiLinearForCausalLM"}
PARTS = ("correctness", "batch1", "w1", "long_context")
# (stage, its parts): each stage is one child process per model.
STAGES = (("correctness", ("correctness",)), ("engine", ("batch1", "w1", "long_context")),
          ("full", ("long_context",)))
WORKLOAD = {"full": "long_context_full_attention"}  # a stage's record names, where not the part's

FULL = dict(dtype="bfloat16", max_model_len=None, b1_in=128, b1_out=256, w1_in=(100, 1024),
            w1_out=(100, 1024), num_requests=256, kv_cache_memory_bytes=None,
            contexts=[1024, 32768, 131072], decode_tokens=32, max_num_batched_tokens=8192,
            corr_prompts=4, corr_len=(20, 300), corr_steps=16, corr_max_model_len=1024,
            corr_kv_bytes=4 << 30, device=None)
SMOKE = dict(dtype="float32", max_model_len=512, b1_in=16, b1_out=12, w1_in=(8, 40),
             w1_out=(4, 16), num_requests=6, kv_cache_memory_bytes=32 << 20,
             contexts=[64, 256, 480], decode_tokens=8, max_num_batched_tokens=128,
             corr_prompts=4, corr_len=(20, 120), corr_steps=16, corr_max_model_len=512,
             corr_kv_bytes=32 << 20, device="cpu")
# GPU memory kept free beside weights and KV when deciding whether a variant fits.
ACTIVATION_MARGIN = 8 << 30

# ---- tiny configs of --smoke (the structure of each family at toy sizes) -------------------
_TINY = {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024,
         "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
         "tie_word_embeddings": False, "torch_dtype": "float32"}
_LINEAR = {"head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
           "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": []}
SMOKE_CONFIGS: dict[str, dict[str, Any]] = {
    "tiny-qwen3-next": {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
                        **_TINY, **_LINEAR, **_MOE},
    "tiny-qwen3.5": {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
                     **_TINY, **_LINEAR},
    "tiny-qwen3.5-moe": {"architectures": ["Qwen3_5MoeForCausalLM"],
                         "model_type": "qwen3_5_moe_text", **_TINY, **_LINEAR, **_MOE},
    "tiny-kimi-linear": {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", **_TINY,
        "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None,
        "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_token": 2,
        "num_shared_experts": 1, "num_expert_group": 2, "topk_group": 1,
        "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid", "use_grouped_topk": True,
        "mla_use_nope": True, "pad_token_id": 0, "rms_norm_eps": 1e-5,
        "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4],
                               "head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4}},
}


def write_smoke_configs(root: Path) -> list[str]:
    out = []
    for name, cfg in SMOKE_CONFIGS.items():
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        out.append(str(root / name))
    return out


# ---- configs -------------------------------------------------------------------------------

def config_folder(model: str) -> Path:
    """A folder as given, else the shipped shape's folder in the shoal tree `import shoal`
    loads (a data file, not an engine API)."""
    if Path(model, "config.json").exists() or model not in CONFIG_FOLDERS:
        return Path(model)
    tree = shoal_source()
    return Path(tree or ".", "shoal", "model_configs", CONFIG_FOLDERS[model])


def raw_config(model: str) -> dict[str, Any]:
    return json.loads((config_folder(model) / "config.json").read_text())


def hf_config(raw: dict[str, Any]) -> Any:
    from transformers import AutoConfig

    kw = {k: v for k, v in raw.items() if k not in ("model_type", "architectures")}
    cfg = AutoConfig.for_model(raw["model_type"], **kw)
    cfg.architectures = raw.get("architectures")
    return cfg


def four_layers(raw: dict[str, Any]) -> dict[str, Any]:
    """3 linear-attention layers, then 1 full-attention layer, at the config's width."""
    raw = {**raw, "num_hidden_layers": 4}
    if raw["model_type"] == "kimi_linear":
        raw["linear_attn_config"] = {**raw["linear_attn_config"], "kda_layers": [1, 2, 3],
                                     "full_attn_layers": [4]}
        raw.pop("layer_types", None)
        raw.pop("mlp_layer_types", None)
    else:
        raw["layer_types"] = ["linear_attention"] * 3 + ["full_attention"]
    return raw


def all_full_attention(raw: dict[str, Any]) -> dict[str, Any]:
    n = raw["num_hidden_layers"]
    raw = dict(raw)
    if raw["model_type"] == "kimi_linear":
        raw["linear_attn_config"] = {**raw["linear_attn_config"], "kda_layers": [],
                                     "full_attn_layers": list(range(1, n + 1))}
        raw.pop("layer_types", None)
    else:
        raw["layer_types"] = ["full_attention"] * n
    return raw


def max_positions(cfg: Any) -> int:
    return int(getattr(cfg, "max_position_embeddings", 0) or 1 << 20)


def config_bytes(cfg: Any, elem: int) -> dict[str, Any]:
    """From the config alone: attention bytes a token (full-attention layers), state bytes a
    sequence (linear layers, float32) and the all-full-attention variant's bytes a token."""
    kinds = list(cfg.layer_types)
    n_full = kinds.count("full_attention")
    if cfg.model_type == "kimi_linear":
        per_layer = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * elem  # one latent row
        heads, d, k = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
        state = 4 * (3 * heads * d * (k - 1) + heads * d * d)
        rule = f"layers x (kv_lora_rank + qk_rope_head_dim) x {elem} B (MLA latent row)"
    else:
        per_layer = 2 * cfg.num_key_value_heads * cfg.head_dim * elem
        nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        state = 4 * ((2 * nk * dk + nv * dv) * (cfg.linear_conv_kernel_dim - 1) + nv * dk * dv)
        rule = f"layers x 2 x kv_heads x head_dim x {elem} B"
    return dict(attention_layers=n_full, linear_layers=len(kinds) - n_full,
                attention_bytes_per_token=n_full * per_layer,
                state_bytes_per_seq=(len(kinds) - n_full) * state,
                state_bytes_per_linear_layer=state,
                full_attention_bytes_per_token=len(kinds) * per_layer,
                full_attention_rule=rule)


def engine_layout(llm: Any) -> dict[str, Any] | None:
    """The pool as the runner laid it out (an internal: None without it)."""
    run = engine_internals.runner(llm)
    groups = getattr(run, "kv_groups", None)
    specs = getattr(run, "kv_specs", None)
    caches = getattr(run, "kv_caches", None)
    if not (groups and specs and caches):
        return None
    bs = int(run.block_size)
    per_slot = sum(kv.numel() // kv.shape[1] * kv.element_size() for kv in caches)
    attn = [g for g in groups if not getattr(g, "holds_state", False)]
    states = [g for g in groups if getattr(g, "holds_state", False)]
    attn_layers = [i for g in attn for i in g.layers]
    state_layers = [i for g in states for i in g.layers]
    num_blocks = int(caches[0].shape[1]) // bs - 1  # one null block past the pool
    return dict(block_size=bs, num_blocks=num_blocks, bytes_per_block=per_slot * bs,
                pool_gib=num_blocks * per_slot * bs / 2**30,
                group_sizes=[len(g.layers) for g in groups], attention_groups=len(attn),
                state_groups=len(states), attention_layers=len(attn_layers),
                linear_layers=len(state_layers),
                attention_bytes_per_token=sum(specs[i].page_bytes(1) for i in attn_layers),
                state_bytes_per_seq=sum(specs[i].state_bytes for i in state_layers),
                source="runner kv_groups / kv_specs / kv_caches")


def seq_bytes(tokens: int, lay: dict[str, Any] | None, cb: dict[str, Any]) -> dict[str, Any]:
    """What one sequence of `tokens` holds: exact, at block granularity, and the all-full
    variant's exact bytes."""
    src = lay or cb
    exact = src["attention_bytes_per_token"] * tokens + src["state_bytes_per_seq"]
    full = cb["full_attention_bytes_per_token"] * tokens
    out = dict(kv_state_bytes_exact=exact, kv_bytes_exact=src["attention_bytes_per_token"] * tokens,
               state_bytes=src["state_bytes_per_seq"], full_attention_kv_bytes=full,
               hybrid_over_full=exact / full if full else None)
    if lay:
        blocks = lay["attention_groups"] * -(-tokens // lay["block_size"]) + lay["state_groups"]
        out |= dict(pool_blocks=blocks, kv_state_bytes_pool=blocks * lay["bytes_per_block"])
    return out


# ---- engines -------------------------------------------------------------------------------

def measure_contexts(llm: Any, contexts: list[int], limit: int, sizes: dict[str, Any],
                     cb: dict[str, Any], vocab: int, seed: int) -> tuple[dict | None, list]:
    """Bytes and timings of each context; contexts over `limit` tokens, or whose blocks the
    pool cannot hold, get bytes only."""
    lay = engine_layout(llm)

    def wont_fit(tokens: int) -> str | None:
        if lay and seq_bytes(tokens, lay, cb)["pool_blocks"] > lay["num_blocks"]:
            return f"needs more than the pool's {lay['num_blocks']} blocks"
        return None

    rows = long_context_runs.measure_contexts(llm, contexts, limit, sizes, vocab, seed,
                                              lambda c: seq_bytes(c, lay, cb), wont_fit)
    return lay, rows


class EngineStage(LazyEngine):
    """The shipped shape on one engine (built on first use) for batch1, w1, long_context."""

    def __init__(self, args: argparse.Namespace, sizes: dict[str, Any], model: str):
        self.args, self.sizes, self.model = args, sizes, model
        self.cfg = hf_config(raw_config(model))
        self.max_model_len = context_max_model_len(args, sizes, max_positions(self.cfg))
        super().__init__(str(config_folder(model)), engine_kw(args, sizes, self.max_model_len))

    def vocab(self) -> int:
        return int(self.cfg.vocab_size)

    def common(self) -> dict[str, Any]:
        return dict(model=self.model, family=self.cfg.model_type, dtype=self.sizes["dtype"],
                    smoke=self.args.smoke, **self.ready_fields(),
                    max_num_seqs=self.args.max_num_seqs, max_model_len=self.max_model_len,
                    enforce_eager=self.args.enforce_eager,
                    max_num_batched_tokens=self.args.max_num_batched_tokens
                    or self.sizes["max_num_batched_tokens"])


def roofline(st: EngineStage, decode: float) -> dict[str, Any]:
    model = getattr(engine_internals.runner(st.llm), "model", None)
    if model is None:
        return dict(roofline_tok_s=None, params=None)
    floor = weight_floor(model, int(getattr(st.cfg, "num_experts_per_tok", 0) or 0), decode)
    lay = engine_layout(st.llm) or config_bytes(st.cfg, floor["params"]["param_bytes"])
    mean_ctx = st.sizes["b1_in"] + st.sizes["b1_out"] / 2
    kv_state = lay["attention_bytes_per_token"] * mean_ctx + 2 * lay["state_bytes_per_seq"]
    with_kv = floor["copy_bandwidth"] / (floor["weight_bytes_per_token"] + kv_state)
    return dict(
        **floor,
        kv_state_bytes_per_decode_token=kv_state, roofline_tok_s_with_kv_state=with_kv,
        fraction_of_roofline_with_kv_state=decode / with_kv,
        active_params_rule=(
            "deepseek_gpu.count_active: all parameters of the engine's model minus the routed "
            "experts' stacked w13/w2, plus num_experts_per_tok x one expert per MoE layer "
            "(router, shared expert and every linear/full attention layer in full)"),
        roofline_rule=("weight_bytes_per_token / the GPU's copy bandwidth; _with_kv_state adds the "
                       "attention KV at the mean context and every linear layer's float32 "
                       "state read and written once per token"))


def batch1(st: EngineStage) -> dict[str, Any]:
    s = st.sizes
    fig = offline_runs.batch1(st.llm, st.vocab(), s["b1_in"], s["b1_out"])
    return record("batch1", "shoal", **st.common(), batch=1, input_len=s["b1_in"],
                  output_len=s["b1_out"], **fig, **roofline(st, fig["decode_tok_s"] or 0),
                  graph_replay_ms=engine_internals.graph_replay_ms(st.llm))


def long_context(st: EngineStage) -> dict[str, Any]:
    elem = 2 if st.sizes["dtype"] == "bfloat16" else 4
    cb = config_bytes(st.cfg, elem)
    lay, rows = measure_contexts(st.llm, contexts_for(st.args, st.sizes), st.max_model_len,
                                 st.sizes, cb, st.vocab(), st.args.seed)
    return record("long_context", "shoal", **st.common(), layout=lay, from_config=cb,
                  contexts=rows, bytes_rule=BYTES_RULE)


BYTES_RULE = ("kv_state_bytes_exact: attention rows a token x tokens + every linear layer's "
              "float32 state; kv_state_bytes_pool: (attention groups x ceil(tokens / "
              "block_size) + state groups) blocks x bytes of a block id (a state group holds "
              "one live block a request; block-end snapshots of a prompt chunk come on top "
              "until its next step); full_attention_kv_bytes: from the config (see "
              "from_config.full_attention_rule)")


def full_attention(args: argparse.Namespace, sizes: dict[str, Any], model: str) -> dict:
    """The same width with every layer full attention, in its own engine where it fits."""
    import torch

    raw = all_full_attention(raw_config(model))
    cfg = hf_config(raw)
    elem = 2 if sizes["dtype"] == "bfloat16" else 4
    cb = config_bytes(cfg, elem)
    decode = sizes["decode_tokens"]
    contexts = contexts_for(args, sizes)
    weights = variant_params(cfg)
    fits, budget = list(contexts), None
    if torch.cuda.is_available() and sizes["kv_cache_memory_bytes"] is None:
        budget = 0.9 * torch.cuda.get_device_properties(0).total_memory - ACTIVATION_MARGIN
        budget -= (weights or 0) * elem
        fits = [c for c in contexts
                if cb["full_attention_bytes_per_token"] * (c + decode + 1) * 1.05 <= budget]
    common = dict(model=model, family=cfg.model_type, dtype=sizes["dtype"], smoke=args.smoke,
                  variant="every layer full attention", variant_params=weights,
                  kv_budget_bytes=budget, enforce_eager=args.enforce_eager,
                  from_config=cb)
    if not fits:
        rows = [dict(context=c, **seq_bytes(c, None, cb),
                     skipped="KV does not fit beside the weights: bytes only") for c in contexts]
        return record(WORKLOAD["full"], "shoal", **common, contexts=rows)
    tmp = tempfile.mkdtemp(prefix="hybrid-full-")
    eng = None
    try:
        (Path(tmp) / "config.json").write_text(json.dumps(raw, indent=2))
        limit = min(max(fits) + decode + 128, max_positions(cfg))
        if sizes["max_model_len"]:
            limit = sizes["max_model_len"]
        eng = offline_runs.start_engine(tmp, **engine_kw(args, sizes, limit))
        lay, rows = measure_contexts(eng.llm, fits, limit, sizes, cb, int(cfg.vocab_size),
                                     args.seed)
        rows += [dict(context=c, **seq_bytes(c, lay, cb),
                      skipped="KV does not fit beside the weights: bytes only")
                 for c in contexts if c not in fits]
        rows.sort(key=lambda r: r["context"])
        return record(WORKLOAD["full"], "shoal", **common, ready_s=eng.ready_s,
                      max_model_len=limit, layout=lay, contexts=rows, bytes_rule=BYTES_RULE)
    finally:
        if eng is not None:
            eng.llm.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
        free_memory()


def variant_params(cfg: Any) -> int | None:
    """Parameters of shoal's model for cfg, built on the meta device."""
    import torch

    try:
        from shoal.models.registry import resolve_model_class

        with torch.device("meta"):
            model = resolve_model_class(cfg)(cfg, torch.bfloat16)
        return sum(p.numel() for p in model.parameters())
    except Exception:
        traceback.print_exc()
        return None


# ---- correctness ---------------------------------------------------------------------------

# write_tiny_checkpoint's draws of the linear layers' decay parameters (hf_agreement.randomize
# draws the rest)
DECAY_DRAWS = {"A_log": lambda p: p.normal_(0, 0.3), "dt_bias": lambda p: p.uniform_(-4, -2)}


def correctness(args: argparse.Namespace, sizes: dict[str, Any], model: str) -> dict:
    import transformers
    from gpu_correctness import hf_greedy  # (imports torch: correctness children only)

    raw = four_layers(raw_config(model))
    name = HF_CLASSES.get(raw["model_type"], "?")
    base = dict(model=model, family=raw["model_type"], hf_class=name, dtype=sizes["dtype"],
                smoke=args.smoke)
    try:
        hf_cls = getattr(transformers, name)
        cfg = hf_config(raw)
    except Exception as e:
        return record("correctness", "shoal", **base, skipped=(
            f"transformers {transformers.__version__} has no class {name} ({type(e).__name__})"))
    device = correctness_device(args.smoke)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(cfg.vocab_size) for _ in range(rng.randint(*sizes["corr_len"]))]
               for _ in range(sizes["corr_prompts"])]
    with hf_and_shoal(lambda dtype: hf_cls._from_config(cfg, dtype=dtype),
                      lambda hf: randomize(hf, DECAY_DRAWS), sizes, device, args.seed,
                      "hybrid-correctness-") as pair:
        return record("correctness", "shoal", **base,
                      **compare(pair.llm, pair.hf, prompts, sizes["corr_steps"], device,
                                hf_greedy),
                      layers=4, layer_types=list(cfg.layer_types),
                      hidden_size=cfg.hidden_size, hf_params=sum(
                          p.numel() for p in pair.hf.parameters()),
                      hf_build_save_s=pair.build_save_s,
                      init_rule=("A_log ~ N(0, 0.3), dt_bias ~ U(-4, -2), vectors U(0.5, 1.5), "
                                 "matrices N(0, 0.2 * min(1, sqrt(64 / fan_in)))"),
                      note="bf16 near-ties diverge: reported, not failed")


# ---- stages and the child processes --------------------------------------------------------

def run_stage(args: argparse.Namespace, sizes: dict[str, Any], stage: str, model: str,
              parts: list[str]) -> None:
    """The stage's parts for one model, each record appended to --out as it comes."""
    if stage == "correctness":
        staged_gpu.run_part(args.out, "correctness", model, correctness, args, sizes, model)
    elif stage == "full":
        staged_gpu.run_part(args.out, WORKLOAD["full"], model, full_attention, args, sizes, model)
    else:
        fns = {"batch1": batch1, "w1": w1, "long_context": long_context}
        staged_gpu.run_engine_parts(args.out, model, lambda: EngineStage(args, sizes, model),
                                    [(p, fns[p]) for p in parts])


def run_child(args: argparse.Namespace, stage: str, model: str, parts: list[str]) -> None:
    """run_stage in a child process; a child that dies leaves error records."""
    staged_gpu.run_child(args, __file__, stage, parts, model=model, extra=["--models", model],
                         workloads=[WORKLOAD.get(stage, p) for p in parts])


def summary(model: str, path: Path) -> dict[str, Any] | None:
    """Hybrid against all-full-attention, context by context, from the two records."""
    recs = {r.get("workload"): r for r in read_records(path) if r.get("model") == model}
    hyb, full = recs.get("long_context"), recs.get(WORKLOAD["full"])
    if not hyb or "contexts" not in hyb:
        return None
    by_ctx = {r["context"]: r for r in (full or {}).get("contexts", [])}
    rows = []
    for h in hyb["contexts"]:
        f = by_ctx.get(h["context"], {})
        hd, fd = h.get("decode_ms_per_token"), f.get("decode_ms_per_token")
        rows.append(dict(context=h["context"], hybrid_decode_ms=hd, full_decode_ms=fd,
                         full_over_hybrid_decode=fd / hd if hd and fd else None,
                         hybrid_prefill_s=h.get("prefill_s"), full_prefill_s=f.get("prefill_s"),
                         hybrid_bytes=h.get("kv_state_bytes_exact"),
                         hybrid_bytes_pool=h.get("kv_state_bytes_pool"),
                         full_bytes=h.get("full_attention_kv_bytes"),
                         full_over_hybrid_bytes=(h["full_attention_kv_bytes"]
                                                 / h["kv_state_bytes_exact"])
                         if h.get("kv_state_bytes_exact") else None))
    return record("long_context_summary", "shoal", model=model, family=hyb.get("family"),
                  smoke=hyb.get("smoke"), contexts=rows)


def run_model(args: argparse.Namespace, sizes: dict[str, Any], model: str,
              parts: list[str]) -> None:
    """Every stage of one model, then its long-context summary."""
    staged_gpu.run_stages(args, STAGES, parts,
                          lambda stage, todo: run_stage(args, sizes, stage, model, todo),
                          lambda stage, todo: run_child(args, stage, model, todo))
    if "long_context" in parts and (rec := summary(model, args.out)) is not None:
        print(json.dumps(rec, default=str), flush=True)
        append(rec, args.out)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = staged_gpu.staged_parser(
        __doc__.split("\n\n")[0], PARTS, STAGES, stage_timeout=3600,
        smoke="CPU, float32, tiny configs of the four families in a temp folder",
        enforce_eager="engines without CUDA graphs (hybrid and all-full-attention alike)")
    ap.add_argument("--models", type=comma_words, default=None,
                    help="comma list of names or folders (default: the four shipped hybrids)")
    args, parts, sizes = staged_gpu.parse_staged(ap, argv, PARTS, FULL, SMOKE)
    if args.stage:  # a child: one model, one stage
        run_stage(args, sizes, args.stage, args.models[0], parts)
        return read_records(args.out)
    tmp = None
    models = args.models
    if models is None and args.smoke:
        tmp = tempfile.TemporaryDirectory(prefix="hybrid-smoke-")
        models = write_smoke_configs(Path(tmp.name))
    models = models or MODELS
    write([], args.out)
    for model in models:
        run_model(args, sizes, model, parts)
    if tmp is not None:
        tmp.cleanup()
    return read_records(args.out)


if __name__ == "__main__":
    # Exit status 1 when a part failed (its record holds the error); the file has them all.
    sys.exit(1 if any("error" in r for r in main()) else 0)
