"""Build a transformers config from the metadata of a GGUF file."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from shoal.loader.gguf_file import GGUFFile
from shoal.loader.gguf_hybrid import hybrid_config_values
from shoal.loader.gguf_names import HYBRID_ARCHITECTURES

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFArchitecture:
    model_type: str  # transformers' model_type
    hf_class: str  # goes into config.architectures so the engine can pick its model class
    permuted_qk: bool  # llama.cpp's converter permutes q/k rows for this architecture


SUPPORTED_ARCHITECTURES: dict[str, GGUFArchitecture] = {
    "llama": GGUFArchitecture("llama", "LlamaForCausalLM", permuted_qk=True),
    "qwen2": GGUFArchitecture("qwen2", "Qwen2ForCausalLM", permuted_qk=False),
    "qwen3": GGUFArchitecture("qwen3", "Qwen3ForCausalLM", permuted_qk=False),
    # DeepSeek-V2 / V2-Lite, V3 and Kimi-K2 all convert to llama.cpp's deepseek2; its rope is
    # ggml's "normal" (interleaved-pair) type, so the converter stores q / kv_a rows as the
    # checkpoints do (no permutation) and shoal's model reorders them itself at load.
    "deepseek2": GGUFArchitecture("deepseek_v2", "DeepseekV2ForCausalLM", permuted_qk=False),
    # Gated DeltaNet hybrids (their tensors' conversion undone in gguf_hybrid.py)
    "qwen3next": GGUFArchitecture("qwen3_next", "Qwen3NextForCausalLM", permuted_qk=False),
    "qwen35": GGUFArchitecture("qwen3_5_text", "Qwen3_5ForCausalLM", permuted_qk=False),
    "qwen35moe": GGUFArchitecture("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM",
                                  permuted_qk=False),
}
# deepseek2 files whose routing is V3's (sigmoid scores, score-correction bias)
_DEEPSEEK_V3 = GGUFArchitecture("deepseek_v3", "DeepseekV3ForCausalLM", permuted_qk=False)

# llama.cpp's expert_gating_func values (gguf.ExpertGatingFuncType)
_GATING_FUNCS = {1: "softmax", 2: "sigmoid"}


def gguf_architecture(gguf: GGUFFile) -> GGUFArchitecture:
    name = gguf.architecture
    arch = SUPPORTED_ARCHITECTURES.get(name)
    if arch is None:
        raise ValueError(
            f"unsupported GGUF architecture {name!r} in {gguf.path}; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    if name == "deepseek2" and deepseek_gating_func(gguf) == "sigmoid":
        return _DEEPSEEK_V3
    return arch


def deepseek_gating_func(gguf: GGUFFile) -> str:
    """"softmax" (DeepSeek-V2) or "sigmoid" (V3, Kimi-K2) routing scores of a deepseek2 file.

    Files converted before llama.cpp wrote expert_gating_func are V2 (llama.cpp then defaults
    to softmax), unless they hold V3's score-correction bias (exp_probs_b)."""
    value = gguf.get("deepseek2.expert_gating_func")
    if value is None:
        has_bias = any(n.endswith(".exp_probs_b.bias") for n in gguf.tensor_names())
        return "sigmoid" if has_bias else "softmax"
    func = _GATING_FUNCS.get(int(value))
    if func is None:
        raise ValueError(f"GGUF file {gguf.path} states deepseek2.expert_gating_func = "
                         f"{value}; shoal supports 1 (softmax) and 2 (sigmoid)")
    return func


# Bounds on the sizes a config may state, far above any real model's: a damaged or hostile
# file must not make the engine allocate terabytes (dummy loads never look at the tensors).
_SIZE_LIMITS = {
    "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "num_hidden_layers": 1 << 12,
    "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12, "head_dim": 1 << 12,
    "max_position_embeddings": 1 << 26, "vocab_size": 1 << 24,
    # DeepSeek (MLA and MoE): only checked where the config has them
    "q_lora_rank": 1 << 16, "kv_lora_rank": 1 << 16, "qk_nope_head_dim": 1 << 12,
    "qk_rope_head_dim": 1 << 12, "v_head_dim": 1 << 12, "n_routed_experts": 1 << 14,
    "num_experts_per_tok": 1 << 14, "n_shared_experts": 1 << 8, "moe_intermediate_size": 1 << 20,
    # Gated DeltaNet hybrids
    "linear_conv_kernel_dim": 1 << 8, "linear_key_head_dim": 1 << 12,
    "linear_value_head_dim": 1 << 12, "linear_num_key_heads": 1 << 12,
    "linear_num_value_heads": 1 << 12, "num_experts": 1 << 14,
    "shared_expert_intermediate_size": 1 << 20,
}


def build_gguf_config(gguf: GGUFFile) -> PretrainedConfig:
    """The transformers config the file's metadata describes; ValueError for anything missing,
    mistyped, out of bounds or inconsistent."""
    try:
        values = _config_values(gguf)
        _check_sizes(gguf, values)
        config = AutoConfig.for_model(gguf_architecture(gguf).model_type, **values)
    except ValueError:
        raise
    except Exception as exc:  # a mistyped field (TypeError), zero heads, transformers' checks
        raise ValueError(f"GGUF file {gguf.path} has metadata shoal cannot use: "
                         f"{type(exc).__name__}: {exc}") from exc
    config.name_or_path = str(gguf.path)
    return config


def _check_sizes(gguf: GGUFFile, values: dict[str, Any]) -> None:
    for name, limit in _SIZE_LIMITS.items():
        v = values.get(name)
        if v is None:
            continue
        if not 0 < v <= limit:
            raise ValueError(f"GGUF file {gguf.path} states {name} = {v}, outside (0, {limit}]")


def _config_values(gguf: GGUFFile) -> dict[str, Any]:
    arch_name = gguf.architecture
    arch = gguf_architecture(gguf)

    def key(suffix: str) -> str:
        return f"{arch_name}.{suffix}"

    hidden_size = int(gguf.require(key("embedding_length")))
    num_heads = int(gguf.require(key("attention.head_count")))
    if num_heads <= 0:
        raise ValueError(f"GGUF file {gguf.path} states {num_heads} attention heads")
    tensor_names = set(gguf.tensor_names())
    values: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "hidden_size": hidden_size,
        "num_hidden_layers": int(gguf.require(key("block_count"))),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(gguf.get(key("attention.head_count_kv"), num_heads)),
        "head_dim": int(gguf.get(key("attention.key_length"), hidden_size // num_heads)),
        "rms_norm_eps": float(gguf.get(key("attention.layer_norm_rms_epsilon"), 1e-6)),
        "max_position_embeddings": int(gguf.get(key("context_length"), 2048)),
        "vocab_size": _vocab_size(gguf, key("vocab_size")),
        "rope_parameters": _rope_parameters(gguf, arch_name),
        # llama.cpp writes no output.weight when the head shares the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "dtype": "float32",
    }
    # MoE-only hybrids may state no dense width (gguf_hybrid fills it in)
    ffn = gguf.get(key("feed_forward_length"))
    if ffn is None and arch_name not in HYBRID_ARCHITECTURES:
        ffn = gguf.require(key("feed_forward_length"))  # raises, naming the key
    if ffn is not None:
        values["intermediate_size"] = int(ffn)
    if arch.model_type == "llama":
        values["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    if arch_name in HYBRID_ARCHITECTURES:
        values.update(hybrid_config_values(gguf, values, tensor_names))
    if arch_name == "deepseek2":
        values.update(_deepseek2_values(gguf, arch, values, tensor_names))
    for config_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        token_id = gguf.get(gguf_key)
        if token_id is not None:
            values[config_key] = int(token_id)
    return values


def _deepseek2_values(gguf: GGUFFile, arch: GGUFArchitecture, values: dict[str, Any],
                      tensor_names: set[str]) -> dict[str, Any]:
    """The MLA and MoE fields of a DeepSeek-V2/V3 config, from the keys llama.cpp's converter
    (DeepseekV2Model in convert_hf_to_gguf.py / conversion/deepseek.py) writes."""

    def get(suffix: str, default: Any = None) -> Any:
        return gguf.get(f"deepseek2.{suffix}", default)

    def require(suffix: str) -> Any:
        return gguf.require(f"deepseek2.{suffix}")

    rope_dim = int(require("rope.dimension_count"))
    if get("attention.key_length_mla") is not None:
        # Converted since llama.cpp's MLA support: key_length / value_length describe the
        # latent cache (kv_lora_rank + rope, kv_lora_rank); the *_mla keys the heads.
        qk_head_dim = int(get("attention.key_length_mla"))
        v_head_dim = int(require("attention.value_length_mla"))
    else:  # older files state the per-head sizes directly
        qk_head_dim = int(require("attention.key_length"))
        v_head_dim = int(require("attention.value_length"))
    if qk_head_dim <= rope_dim:
        raise ValueError(f"GGUF file {gguf.path} states a {qk_head_dim}-wide query/key head "
                         f"with {rope_dim} rotary dimensions: no room for the non-rotary part")
    has_q_lora = any(name.endswith(".attn_q_a.weight") for name in tensor_names)
    out: dict[str, Any] = {
        "kv_lora_rank": int(require("attention.kv_lora_rank")),
        # V2-Lite projects queries directly (attn_q); the others through a low-rank q_a/q_b
        "q_lora_rank": int(require("attention.q_lora_rank")) if has_q_lora else None,
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": qk_head_dim - rope_dim,
        "v_head_dim": v_head_dim,
        # MLA is multi-head after decompression; llama.cpp writes head_count_kv = 1
        "num_key_value_heads": values["num_attention_heads"],
        "attention_bias": False,
    }
    del values["head_dim"]  # transformers derives it (the rotary width) for DeepSeek
    layers = values["num_hidden_layers"]
    experts = int(get("expert_count", 0) or 0)
    if not experts:  # a dense model in this layout: every layer is a leading dense one
        out["first_k_dense_replace"] = layers
        return out
    n_group = int(get("expert_group_count", 1) or 1)
    topk_group = int(get("expert_group_used_count", n_group) or n_group)
    normalize = bool(get("expert_weights_norm", False))
    out.update({
        "n_routed_experts": experts,
        "num_experts_per_tok": int(require("expert_used_count")),
        "moe_intermediate_size": int(require("expert_feed_forward_length")),
        "n_shared_experts": int(get("expert_shared_count", 0)),
        "first_k_dense_replace": int(get("leading_dense_block_count", 0)),
        "moe_layer_freq": 1,  # llama.cpp: every layer after the leading dense ones is sparse
        # absent when the checkpoint had none; llama.cpp then does not scale
        "routed_scaling_factor": float(get("expert_weights_scale", 1.0)),
        "norm_topk_prob": normalize,
        "n_group": n_group,
        "topk_group": topk_group,
    })
    if arch.model_type == "deepseek_v3":
        out["rope_interleave"] = True  # ggml's normal rope: interleaved pairs, as V3's default
        out["num_nextn_predict_layers"] = 0  # the converter drops the MTP layers
    else:
        if normalize:
            raise ValueError(
                f"GGUF file {gguf.path} has softmax (DeepSeek-V2) routing with "
                f"expert_weights_norm set; shoal's V2 routing, like transformers', never "
                f"renormalizes the top-k weights")
        grouped = n_group > 1 and topk_group < n_group
        out["topk_method"] = "group_limited_greedy" if grouped else "greedy"
    return out


def _vocab_size(gguf: GGUFFile, metadata_key: str) -> int:
    size = gguf.get(metadata_key)
    if size is not None:
        return int(size)
    for tensor in gguf.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # GGUF lists ne0 (hidden) first, rows (vocab) last
    tokens = gguf.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return tokens.count
    raise ValueError(f"GGUF file {gguf.path} states no vocabulary size and has no token_embd")


def _rope_parameters(gguf: GGUFFile, arch_name: str) -> dict[str, Any]:
    theta = float(gguf.get(f"{arch_name}.rope.freq_base", 10000.0))
    scaling = gguf.get(f"{arch_name}.rope.scaling.type")
    factor = gguf.get(f"{arch_name}.rope.scaling.factor")
    if scaling in (None, "none") or factor is None:
        if "rope_freqs.weight" in gguf.tensor_names():
            # llama3-style scaling is stored as a per-frequency tensor whose original parameters
            # cannot be recovered exactly; plain rope is close for prompts within the original window
            logger.warning(
                "%s: ignoring rope_freqs (llama3 rope scaling is not supported)", gguf.path
            )
        return {"rope_type": "default", "rope_theta": theta}
    params: dict[str, Any] = {
        "rope_type": str(scaling),
        "rope_theta": theta,
        "factor": float(factor),
    }
    original = gguf.get(f"{arch_name}.rope.scaling.original_context_length")
    if original is not None:
        params["original_max_position_embeddings"] = int(original)
    # what llama.cpp's converter copies from a yarn config's rope parameters
    for gguf_key, config_key in (
        ("yarn_beta_fast", "beta_fast"),
        ("yarn_beta_slow", "beta_slow"),
        ("yarn_attn_factor", "attention_factor"),
    ):
        value = gguf.get(f"{arch_name}.rope.scaling.{gguf_key}")
        if value is not None:
            params[config_key] = float(value)
    log_multiplier = gguf.get(f"{arch_name}.rope.scaling.yarn_log_multiplier")
    if arch_name == "deepseek2" and log_multiplier is not None and float(log_multiplier):
        # The deepseek2 converter stores 0.1 * mscale_all_dim (llama.cpp's loader divides by
        # 0.1 again: TAG_DEEPSEEK2_YARN_LOG_MUL_FIX). It has no mscale; llama.cpp takes it to
        # equal mscale_all_dim, which leaves the cos/sin table unscaled, as in every DeepSeek
        # config. Rounded to 6 decimals to undo the float32 storage (0.0707 -> 0.707).
        mscale_all_dim = round(float(log_multiplier) / 0.1, 6)
        params["mscale"] = mscale_all_dim
        params["mscale_all_dim"] = mscale_all_dim
    return params
