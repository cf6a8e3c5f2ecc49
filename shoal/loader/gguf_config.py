"""Build a transformers config from the metadata of a GGUF file."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from transformers import AutoConfig, PretrainedConfig

from shoal.loader.gguf_file import GGUFFile

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
}


def gguf_architecture(gguf: GGUFFile) -> GGUFArchitecture:
    name = gguf.architecture
    arch = SUPPORTED_ARCHITECTURES.get(name)
    if arch is None:
        raise ValueError(
            f"unsupported GGUF architecture {name!r} in {gguf.path}; "
            f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
        )
    return arch


# Bounds on the sizes a config may state, far above any real model's: a damaged or hostile
# file must not make the engine allocate terabytes (dummy loads never look at the tensors).
_SIZE_LIMITS = {
    "hidden_size": 1 << 17, "intermediate_size": 1 << 20, "num_hidden_layers": 1 << 12,
    "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12, "head_dim": 1 << 12,
    "max_position_embeddings": 1 << 26, "vocab_size": 1 << 24,
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
        v = values[name]
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
        "intermediate_size": int(gguf.require(key("feed_forward_length"))),
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
    if arch.model_type == "llama":
        values["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    for config_key, gguf_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
        ("pad_token_id", "tokenizer.ggml.padding_token_id"),
    ):
        token_id = gguf.get(gguf_key)
        if token_id is not None:
            values[config_key] = int(token_id)
    return values


def _vocab_size(gguf: GGUFFile, metadata_key: str) -> int:
    size = gguf.get(metadata_key)
    if size is not None:
        return int(size)
    for tensor in gguf.reader.tensors:
        if tensor.name == "token_embd.weight":
            return int(tensor.shape[-1])  # GGUF lists ne0 (hidden) first, rows (vocab) last
    tokens = gguf.reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        return len(tokens.data)
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
    return params
