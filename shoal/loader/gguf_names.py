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

_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"^([a-z_]+)\.(weight|bias)$")


class LayerTensor(NamedTuple):
    layer: int
    part: str  # attn_q, ffn_gate_exps, ...
    kind: str  # weight or bias


def layer_tensor(gguf_name: str) -> LayerTensor | None:
    """blk.3.attn_q.weight -> LayerTensor(3, "attn_q", "weight"); None for other names."""
    match = _LAYER_NAME.match(gguf_name)
    if match is None:
        return None
    return LayerTensor(int(match[1]), match[2], match[3])


def expert_tensor_name(layer: int, expert: int, projection: str) -> str:
    """The name one expert's projection has in Hugging Face checkpoints."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"


def hf_tensor_name(gguf_name: str) -> str | None:
    """The transformers name, None for tensors to skip; raises KeyError for unknown ones and
    for the tensors that need more than a rename (EXPERT_PROJECTIONS, KV_B_PARTS)."""
    if gguf_name in SKIPPED:
        return None
    parsed = layer_tensor(gguf_name)
    if parsed is not None:
        layer, part, kind = parsed
        if part in _SKIPPED_LAYER_PARTS:
            return None
        if part in _PER_LAYER:
            return f"model.layers.{layer}.{_PER_LAYER[part]}.{kind}"
        if (part, kind) in _PER_LAYER_EXACT:
            return f"model.layers.{layer}.{_PER_LAYER_EXACT[part, kind]}"
    match = _GLOBAL_NAME.match(gguf_name)
    if match is not None and match.group(1) in _GLOBAL:
        return f"{_GLOBAL[match.group(1)]}.{match.group(2)}"
    raise KeyError(gguf_name)
