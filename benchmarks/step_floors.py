"""The weight-read floor of a batch-1 decode step by part, for benchmarks/step_profile_gpu.py:
gpt-oss by gpt_oss_gpu.active_bytes, a dense decoder by its config's arithmetic, any other
MoE model by its built model's parameters (moe_active_bytes), each part beside the eager
kernel time of the module kinds that read its bytes (FLOOR_KINDS)."""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

import engine_internals
from gpt_oss_gpu import active_bytes
from trace_charges import StepFigures

# the floor's parts, by the kinds whose kernels read their bytes
FLOOR_KINDS = {"attention": ("attention_linears", "attention_other"),
               "mlp": ("mlp_linears", "activation"), "active_experts": ("experts",),
               "shared_experts": ("shared_experts",), "router": ("router",),
               "norms": ("norms",), "embedding_row": ("embedding",), "lm_head": ("lm_head",)}
# a module path inside attention (its projections, q/kv norms, MLA's latent weights)
IN_ATTENTION = re.compile(r"(^|\.)(self_attn|attn|attention)(\.|$)")


def dense_active_bytes(cfg: dict[str, Any], dense_bytes: int) -> dict[str, Any] | None:
    """A dense decoder's bytes a batch-1 token reads by part (None: a MoE config)."""
    if is_moe(cfg):
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


def weight_part(name: str, module: Any, experts: Collection[str]) -> str:
    """The floor part of a module's own parameters, by its dotted name and class; `experts`
    holds the names of the FusedMoE modules (their weights and everything under them)."""
    cls, last = type(module).__name__, name.rsplit(".", 1)[-1]
    if _owner(name, experts) is not None:
        return "active_experts"
    if "shared_expert" in name:  # DeepSeek's shared_experts, Qwen2-MoE's shared_expert(_gate)
        return "shared_experts"
    if cls.endswith("Router") or last in ("router", "gate"):
        return "router"
    if IN_ATTENTION.search(name):  # projections, q/kv norms, MLA's kv_b_proj
        return "attention"
    if last == "lm_head":
        return "lm_head"
    if cls.endswith("Embedding") or last == "embed_tokens":
        return "embedding_row"
    if "Norm" in cls:
        return "norms"
    if ".mlp." in f".{name}.":  # a dense MLP layer (DeepSeek's first_k_dense_replace)
        return "mlp"
    return "other"


def _owner(name: str, experts: Collection[str]) -> str | None:
    """The FusedMoE module `name` is or lies under (None: none)."""
    return next((e for e in experts if name == e or name.startswith(e + ".")), None)


def moe_active_bytes(model: Any, top_k: int) -> dict[str, Any]:
    """The bytes a batch-1 token reads by part, from a built MoE model's parameters (their
    real shapes and dtypes: DeepSeek's float32 router gate counts 4 bytes a weight): a
    FusedMoE module's parameters x top_k / its experts (a token runs top_k experts of each
    MoE layer), one row of the embedding table, everything else whole. A tied LM head counts
    in full beside its embedding row; a tensor counts once per part. Parameters, the buffers
    of the experts (FusedMoE.install_* keeps FP8 / INT4 / MXFP4 experts as buffers) and a
    linear layer's packed weights (`quant`: shoal/quantization/fast_path.py empties its
    `weight`); other buffers (rotary caches) are not weights. Under expert parallelism a
    rank counts all top_k experts as its own: the busiest rank's floor at batch 1."""
    modules = dict(model.named_modules())
    experts = {n: m for n, m in modules.items() if type(m).__name__ == "FusedMoE"}
    parts: dict[str, int] = dict.fromkeys(FLOOR_KINDS, 0)
    seen: set[tuple[int, str]] = set()
    table, table_ids = 0, set()
    for name, module in modules.items():
        part = weight_part(name, module, experts)
        tensors = list(module.parameters(recurse=False))
        if part == "active_experts":
            tensors += list(module.buffers(recurse=False))
        elif getattr(module, "quant", None) is not None and hasattr(module.quant, "nbytes"):
            parts[part] = parts.get(part, 0) + int(module.quant.nbytes)
        for p in tensors:
            if (id(p), part) in seen:
                continue
            seen.add((id(p), part))
            nbytes = p.numel() * p.element_size()
            if part == "active_experts":
                moe = experts[_owner(name, experts) or name]
                nbytes = nbytes * top_k // int(getattr(moe, "local_num_experts", 0)
                                               or moe.num_experts)
            elif part == "embedding_row":
                table += nbytes
                table_ids.add(id(p))
                nbytes = p.shape[-1] * p.element_size()
            parts[part] = parts.get(part, 0) + nbytes
    head = modules.get("lm_head")
    if head is not None and any(id(p) in table_ids for p in head.parameters(recurse=False)):
        table = 0  # (tied: the LM head already counts the whole table)
    parts = {k: v for k, v in parts.items() if v}  # (no shared experts, no dense layer)
    total = sum(parts.values())
    return dict(bytes_per_token=total, bytes_by_part=parts,
                bytes_per_token_whole_embedding=total - parts.get("embedding_row", 0) + table)


def model_weights(llm: Any, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """moe_active_bytes of the engine's model (None: a dense or gpt-oss config, whose floor
    comes from the config, or no model reachable)."""
    if not is_moe(cfg) or cfg.get("model_type") == "gpt_oss":
        return None
    model = getattr(engine_internals.runner(llm), "model", None)
    top_k = cfg.get("num_experts_per_tok", cfg.get("num_experts_per_token"))  # (Kimi's name)
    return None if model is None else moe_active_bytes(model, int(top_k))


def is_moe(cfg: dict[str, Any]) -> bool:
    return any(cfg.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts"))


def floor_table(cfg: dict[str, Any], dense_bytes: int, bandwidth: float,
                eager: StepFigures | None, weights: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    """The floor by part beside the eager kernel time of its kinds. weights: a MoE model's
    moe_active_bytes (gpt-oss and dense configs use their config rules instead)."""
    extra: dict[str, Any] = {}
    if cfg.get("model_type") == "gpt_oss":
        b = active_bytes(cfg, dense_bytes)
        rule = "gpt_oss_gpu.active_bytes (MXFP4 experts, the rest in the model dtype)"
    elif is_moe(cfg):
        b = weights
        rule = ("MoE: the built model's parameters by name (moe_active_bytes): attention "
                "(q/k/v/o or MLA's q, kv_a, kv_b, o and their norms), router gates, top_k "
                "routed experts a MoE layer, shared experts, dense MLP layers, norms, one "
                "embedding row, LM head")
        if b is not None:
            whole = b["bytes_per_token_whole_embedding"]
            extra = dict(bytes_per_token_whole_embedding=whole,
                         floor_us_whole_embedding=whole / bandwidth * 1e6)
    else:
        b = dense_active_bytes(cfg, dense_bytes)
        rule = "dense decoder: q/k/v/o, gate/up/down, norms, one embedding row, LM head"
    if b is None:
        return dict(floor_rule="MoE config and no built model to count (no section ran)",
                    parts=[])
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
                floor_us=total, floor_tok_s=1e6 / total, **extra, parts=parts)
