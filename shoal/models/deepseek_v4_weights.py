"""DeepSeek-V4 checkpoint tensor names -> shoal's parameter names.

Two spellings reach load_weights: the checkpoint's own (DeepSeek's release, and what
transformers' save_pretrained writes back: `layers.N.attn.wq_a`, `ffn.experts.E.w1`,
`hc_attn_fn`, `attn_sink`, `compressor.ape`, `embed`, `head`, ...) and transformers'
in-memory names (`self_attn.q_a_proj`, `mlp.experts.gate_up_proj` stacked, `attn_hc.fn`),
which shoal's modules follow. The rules below turn the first into the second; names already
in transformers' spelling pass through (but for the indexer's `scorer.`, which shoal's
indexer does not have). The multi-token-prediction layers (`mtp.*`, or layers past
num_hidden_layers) map to None: they are not loaded yet."""

from __future__ import annotations

import re

_ATTN = {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj",
         "norm": "kv_norm", "wo_a": "o_a_proj", "wo_b": "o_b_proj"}
_COMPRESSOR = {"wkv": "kv_proj", "wgate": "gate_proj", "norm": "kv_norm"}
_FFN = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

# (pattern on a decoder layer's part of the name, replacement), first match wins
_LAYER_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(p), r) for p, r in [
        (r"^attn_norm\.", "input_layernorm."),
        (r"^ffn_norm\.", "post_attention_layernorm."),
        (r"^hc_(attn|ffn)_(fn|base|scale)$", r"\1_hc.\2"),
        (r"^attn\.attn_sink$", "self_attn.sinks"),
        (r"^attn\.indexer\.compressor\.ape$", "self_attn.compressor.indexer.position_bias"),
        *[(rf"^attn\.indexer\.compressor\.{k}\.", f"self_attn.compressor.indexer.{v}.")
          for k, v in _COMPRESSOR.items()],
        (r"^attn\.indexer\.wq_b\.", "self_attn.compressor.indexer.q_b_proj."),
        (r"^attn\.indexer\.weights_proj\.", "self_attn.compressor.indexer.weights_proj."),
        (r"^attn\.compressor\.ape$", "self_attn.compressor.position_bias"),
        *[(rf"^attn\.compressor\.{k}\.", f"self_attn.compressor.{v}.")
          for k, v in _COMPRESSOR.items()],
        *[(rf"^attn\.{k}\.", f"self_attn.{v}.") for k, v in _ATTN.items()],
        (r"^ffn\.gate\.bias$", "mlp.gate.e_score_correction_bias"),
        (r"^ffn\.gate\.", "mlp.gate."),
        *[(rf"^ffn\.(shared_experts|experts\.\d+)\.{k}\.", rf"mlp.\1.{v}.")
          for k, v in _FFN.items()],
        (r"\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),  # transformers'
    ])
_TOP = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
        "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
        "hc_head_scale": "model.hc_head.hc_scale"}
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(.*)$")


def shoal_name(name: str, num_layers: int) -> str | None:
    """The parameter `name` fills, or None for a multi-token-prediction tensor."""
    if name.startswith(("mtp.", "model.mtp.")):
        return None
    if name in _TOP:
        return _TOP[name]
    m = _LAYER.match(name)
    if m is None:
        return name if name.startswith(("model.", "lm_head.")) else f"model.{name}"
    if int(m[1]) >= num_layers:
        return None
    rest = m[2]
    for pattern, replacement in _LAYER_RULES:
        if pattern.search(rest):
            rest = pattern.sub(replacement, rest, count=1)
            break
    return f"model.layers.{m[1]}.{rest}"
