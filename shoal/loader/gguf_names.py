"""Map llama.cpp tensor names (blk.N.attn_q.weight) to transformers parameter names."""

from __future__ import annotations

import re

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
}

# Tensors llama.cpp stores that are not model parameters (rope tables it can recompute).
SKIPPED = {"rope_freqs.weight"}
_SKIPPED_LAYER_PARTS = {"attn_rot_embd"}

_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_0-9]+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str | None:
    """The transformers name, None for tensors to skip; raises KeyError for unknown ones."""
    if gguf_name in SKIPPED:
        return None
    match = _LAYER_NAME.match(gguf_name)
    if match is not None:
        layer, part, kind = match.groups()
        if part in _SKIPPED_LAYER_PARTS:
            return None
        if part in _PER_LAYER:
            return f"model.layers.{layer}.{_PER_LAYER[part]}.{kind}"
    match = _GLOBAL_NAME.match(gguf_name)
    if match is not None and match.group(1) in _GLOBAL:
        return f"{_GLOBAL[match.group(1)]}.{match.group(2)}"
    raise KeyError(gguf_name)
