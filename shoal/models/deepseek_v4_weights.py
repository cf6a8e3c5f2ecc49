"""DeepSeek-V4 checkpoint tensor names -> shoal's parameter names.

Two spellings reach load_weights: the checkpoint's own (DeepSeek's release, and what
transformers' save_pretrained writes back: `layers.N.attn.wq_a`, `ffn.experts.E.w1`,
`hc_attn_fn`, `attn_sink`, `compressor.ape`, `embed`, `head`, ...) and transformers'
in-memory names (`self_attn.q_a_proj`, `mlp.experts.gate_up_proj` stacked, `attn_hc.fn`),
which shoal's modules follow. The rules below turn the first into the second; names already
in transformers' spelling pass through (but for the indexer's `scorer.`, which shoal's
indexer does not have). The multi-token-prediction layers (`mtp.*`, or layers past
num_hidden_layers) map to None for the main model: the MTP drafter loads them (mtp_name,
shoal/models/deepseek_v4_mtp.py)."""

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


# An MTP layer's own tensors (the rest are its decoder block's): DeepSeek's release spelling
# -> DeepseekV4MTP's parameters; an embedding or head copy is optional (the target's is shared)
_MTP_OWN = {"e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight",
            "enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
            "norm.weight": "norm.weight", "hc_head_fn": "hc_head.hc_fn",
            "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale",
            "emb.tok_emb.weight": "embed_tokens.weight", "embed.weight": "embed_tokens.weight",
            "head.weight": "lm_head.weight"}
_MTP = re.compile(r"^(?:model\.)?mtp\.(\d+)\.(.*)$")


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
    return f"model.layers.{m[1]}.{layer_part_name(m[2])}"


def layer_part_name(rest: str) -> str:
    """A decoder layer's part of a tensor name (`attn.wq_a.weight`, `hc_ffn_fn`) in shoal's
    spelling (`self_attn.q_a_proj.weight`, `ffn_hc.fn`)."""
    for pattern, replacement in _LAYER_RULES:
        if pattern.search(rest):
            return pattern.sub(replacement, rest, count=1)
    return rest


def mtp_name(name: str, depth: int = 0) -> str | None:
    """The DeepseekV4MTP parameter the release's `mtp.{depth}.*` tensor fills (its decoder
    block's under `mtp_block.`); None: not a tensor of that MTP layer."""
    m = _MTP.match(name)
    if m is None or int(m[1]) != depth:
        return None
    rest = m[2]
    return _MTP_OWN.get(rest) or f"mtp_block.{layer_part_name(rest)}"
