"""Map llama.cpp tensor names (blk.N.attn_q.weight) to transformers parameter names."""

from __future__ import annotations

import re
from typing import NamedTuple

_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # DeepSeek-V2/V3 (llama.cpp's deepseek2): multi-head latent attention ...
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
    # ... and the router and shared experts of its MoE layers
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
}

# Tensors whose transformers name drops the .weight/.bias suffix llama.cpp adds.
_PER_LAYER_EXACT = {
    # llama.cpp's converter renames e_score_correction_bias to e_score_correction.bias first
    ("exp_probs_b", "bias"): "mlp.gate.e_score_correction_bias",
}

# The Gated DeltaNet hybrids (llama.cpp's qwen3next, qwen35, qwen35moe): the linear-attention
# layers' tensors, the norm after attention (post_attention_norm: these files have no
# ffn_norm) and Qwen's singular shared expert with its sigmoid gate. Qwen3-Next's attn_qkv +
# attn_gate are one checkpoint tensor (in_proj_qkvz), joined by the loader.
_HYBRID_PER_LAYER = {
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_ba": "linear_attn.in_proj_ba",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
}
_HYBRID_EXACT = {
    ("ssm_a", ""): "linear_attn.A_log",  # stored as -exp(A_log), without a suffix
    ("ssm_dt", "bias"): "linear_attn.dt_bias",  # the converter renames dt_bias dt_proj.bias
}
HYBRID_ARCHITECTURES = ("qwen3next", "qwen35", "qwen35moe")
# Qwen3-Next's attn_qkv and attn_gate, joined into in_proj_qkvz
QKVZ_PARTS = ("attn_qkv", "attn_gate")

# Routed experts, stacked [experts, rows, columns] in one tensor per projection (llama.cpp's
# converter merges the checkpoint's per-expert tensors): the transformers projections each
# expert's slice holds. ffn_gate_up_exps (converted with --fuse-gate-up-exps) stacks gate's
# rows, then up's.
EXPERT_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "ffn_gate_exps": ("gate_proj",),
    "ffn_up_exps": ("up_proj",),
    "ffn_down_exps": ("down_proj",),
    "ffn_gate_up_exps": ("gate_proj", "up_proj"),
}

# DeepSeek MLA: llama.cpp's converter (since its MLA support) splits kv_b_proj per head into
# k_b (transposed: [heads, kv_lora_rank, qk_nope]) and v_b ([heads, v_head_dim, kv_lora_rank]);
# the two are reassembled into kv_b_proj.
KV_B_PARTS = ("attn_k_b", "attn_v_b")

# Tensors llama.cpp stores that are not model parameters (rope tables it can recompute).
SKIPPED = {"rope_freqs.weight"}
_SKIPPED_LAYER_PARTS = {"attn_rot_embd"}

# the suffix is missing on a few SSM tensors (ssm_a)
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)(?:\.(weight|bias))?$")
_BLOCK = re.compile(r"^blk\.(\d+)\.")
_GLOBAL_NAME = re.compile(r"^([a-z_]+)\.(weight|bias)$")


class LayerTensor(NamedTuple):
    layer: int
    part: str  # attn_q, ffn_gate_exps, ...
    kind: str  # weight, bias or "" (no suffix)


def layer_tensor(gguf_name: str) -> LayerTensor | None:
    """blk.3.attn_q.weight -> LayerTensor(3, "attn_q", "weight"); None for other names."""
    match = _LAYER_NAME.match(gguf_name)
    if match is None:
        return None
    return LayerTensor(int(match[1]), match[2], match[3] or "")


def block_of(gguf_name: str) -> int:
    """The block index of a blk.N.* tensor (blk.48.nextn.eh_proj.weight too); -1 for others."""
    match = _BLOCK.match(gguf_name)
    return int(match[1]) if match else -1


def expert_tensor_name(layer: int, expert: int, projection: str) -> str:
    """The name one expert's projection has in Hugging Face checkpoints."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"


def hf_tensor_name(gguf_name: str, architecture: str = "") -> str | None:
    """The transformers name, None for tensors to skip; raises KeyError for unknown ones and
    for the tensors that need more than a rename (EXPERT_PROJECTIONS, KV_B_PARTS)."""
    if gguf_name in SKIPPED:
        return None
    hybrid = architecture in HYBRID_ARCHITECTURES
    parsed = layer_tensor(gguf_name)
    if parsed is not None:
        layer, part, kind = parsed
        if part in _SKIPPED_LAYER_PARTS:
            return None
        per_layer = {**_PER_LAYER, **_HYBRID_PER_LAYER} if hybrid else _PER_LAYER
        exact = {**_PER_LAYER_EXACT, **_HYBRID_EXACT} if hybrid else _PER_LAYER_EXACT
        if part in per_layer and kind:
            return f"model.layers.{layer}.{per_layer[part]}.{kind}"
        if (part, kind) in exact:
            return f"model.layers.{layer}.{exact[part, kind]}"
    match = _GLOBAL_NAME.match(gguf_name)
    if match is not None and match.group(1) in _GLOBAL:
        return f"{_GLOBAL[match.group(1)]}.{match.group(2)}"
    raise KeyError(gguf_name)
