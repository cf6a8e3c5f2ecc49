"""llama.cpp's Gated DeltaNet hybrids (qwen3next, qwen35, qwen35moe) read back as the
checkpoints they were converted from.

llama.cpp's converter (Qwen3NextModel and its Qwen3.5 subclasses in convert_hf_to_gguf.py)
changes these tensors on the way in, and each change is undone here:
- RMSNorm weights of the offset form ((1 + w) * x) are stored as 1 + w, except the linear
  layers' gated norm (linear_attn.norm), which is a plain one;
- A_log is stored as A = -exp(A_log) (ssm_a), dt_bias as ssm_dt.bias;
- the conv1d weight [C, 1, K] loses its middle axis;
- Qwen3-Next's in_proj_qkvz, which interleaves every key head's q, k, v and z rows, is split
  into attn_qkv (all q, all k, all v) and attn_gate (all z);
- Qwen3.5 with more value heads than key heads has its value heads reordered from grouped by
  key head (k0's v0..v{r-1}, k1's ...) to tiled (k0 v0, k1 v0, ..., k0 v1, ...) everywhere a
  tensor has one entry per value head or value channel;
- Qwen3.5's MTP layer is appended as extra blocks (nextn_predict_layers of them), which the
  engine does not take from a GGUF file: they are left out.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from transformers import PretrainedConfig

from shoal.loader.gguf_file import GGUFFile

_QWEN35 = ("qwen35", "qwen35moe")


def mtp_blocks(gguf: GGUFFile) -> int:
    """The trailing blocks that hold Qwen3.5's multi-token-prediction layer."""
    return int(gguf.get(f"{gguf.architecture}.nextn_predict_layers", 0) or 0)


def hybrid_config_values(gguf: GGUFFile, values: dict[str, Any],
                         tensor_names: set[str]) -> dict[str, Any]:
    """The linear-attention, layer-layout and MoE fields of the config."""
    arch = gguf.architecture

    def get(suffix: str, default: Any = None) -> Any:
        return gguf.get(f"{arch}.{suffix}", default)

    def require(suffix: str) -> Any:
        return gguf.require(f"{arch}.{suffix}")

    layers = values["num_hidden_layers"] - mtp_blocks(gguf)
    if layers <= 0:
        raise ValueError(f"GGUF file {gguf.path} states {values['num_hidden_layers']} blocks, "
                         f"all of them multi-token-prediction layers")
    value_heads = int(require("ssm.time_step_rank"))
    inner = int(require("ssm.inner_size"))
    if value_heads <= 0 or inner % value_heads:
        raise ValueError(f"GGUF file {gguf.path} states ssm.inner_size {inner} for "
                         f"{value_heads} value heads (ssm.time_step_rank)")
    key_heads = int(require("ssm.group_count"))
    if key_heads <= 0 or value_heads % key_heads:
        raise ValueError(f"GGUF file {gguf.path} states {value_heads} value heads for "
                         f"{key_heads} key heads (ssm.group_count): not a multiple")
    interval = int(get("full_attention_interval", 4))
    if interval <= 0:
        raise ValueError(f"GGUF file {gguf.path} states full_attention_interval {interval}")
    head_dim = values["head_dim"]
    rotary = int(get("rope.dimension_count", head_dim))
    rope = dict(values["rope_parameters"], partial_rotary_factor=rotary / head_dim)
    sections = get("rope.dimension_sections")
    if arch in _QWEN35 and sections is not None:
        # text positions are equal in every section, so interleaved MRoPE is plain rotary;
        # kept so the config reads as the checkpoint's
        rope.update(mrope_section=[int(s) for s in list(sections)[:3]], mrope_interleaved=True)
    out: dict[str, Any] = {
        "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                        for i in range(layers)],
        "full_attention_interval": interval,
        "linear_conv_kernel_dim": int(require("ssm.conv_kernel")),
        "linear_key_head_dim": int(require("ssm.state_size")),
        "linear_num_key_heads": key_heads,
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": inner // value_heads,
        "partial_rotary_factor": rotary / head_dim,
        "rope_parameters": rope,
        "attention_bias": False,
    }
    if arch == "qwen35":
        return out
    experts = int(require("expert_count"))
    out.update({
        "num_experts": experts,
        "num_experts_per_tok": int(require("expert_used_count")),
        "moe_intermediate_size": int(require("expert_feed_forward_length")),
        "shared_expert_intermediate_size": int(require("expert_shared_feed_forward_length")),
        # llama.cpp renormalizes the top-k weights of these models unless told otherwise
        "norm_topk_prob": bool(get("expert_weights_norm", True)),
    })
    if "intermediate_size" not in values:  # only MoE layers: the dense width is unused
        out["intermediate_size"] = out["moe_intermediate_size"]
    if arch == "qwen3next":
        # a layer without a router is a dense one (mlp_only_layers)
        out["decoder_sparse_step"] = 1
        out["mlp_only_layers"] = [i for i in range(layers)
                                  if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names]
    return out


def _grouped_value_heads(values: np.ndarray, axis: int, key_heads: int, per_key: int,
                         width: int) -> np.ndarray:
    """Tiled value-head order (per_key blocks of key_heads heads) back to grouped by key
    head (key_heads blocks of per_key heads); `width` entries per head along `axis`."""
    shape = values.shape
    split = values.reshape(*shape[:axis], per_key, key_heads, width, *shape[axis + 1:])
    return np.ascontiguousarray(np.swapaxes(split, axis, axis + 1)).reshape(shape)


def restore_tensor(hf_name: str, values: np.ndarray, config: PretrainedConfig,
                   architecture: str) -> np.ndarray:
    """The checkpoint's values of one tensor, from what the converter stored."""
    if hf_name.endswith("norm.weight") and not hf_name.endswith("linear_attn.norm.weight"):
        return values - np.float32(1.0)
    if ".linear_attn." not in hf_name:
        return values
    if hf_name.endswith(".A_log"):
        with np.errstate(divide="raise", invalid="raise"):
            try:
                values = np.log(-values)
            except FloatingPointError:
                raise ValueError(f"{hf_name}: the file's ssm_a is not negative everywhere "
                                 f"(it stores -exp(A_log))") from None
    elif hf_name.endswith(".conv1d.weight"):
        values = values.reshape(values.shape[0], 1, -1)
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    if architecture not in _QWEN35 or nk == nv:
        return values
    r, dk, dv = nv // nk, config.linear_key_head_dim, config.linear_value_head_dim
    if hf_name.endswith(".in_proj_qkv.weight") or hf_name.endswith(".conv1d.weight"):
        qk = 2 * nk * dk  # only the value rows (channels) were reordered
        v = _grouped_value_heads(values[qk:], 0, nk, r, dv)
        return np.concatenate([values[:qk], v], axis=0)
    if hf_name.endswith(".in_proj_z.weight"):
        return _grouped_value_heads(values, 0, nk, r, dv)
    if hf_name.endswith((".in_proj_a.weight", ".in_proj_b.weight", ".A_log", ".dt_bias")):
        return _grouped_value_heads(values, 0, nk, r, 1)
    if hf_name.endswith(".out_proj.weight"):
        return _grouped_value_heads(values, 1, nk, r, dv)
    return values


def join_qkvz(qkv: np.ndarray, z: np.ndarray, config: PretrainedConfig) -> np.ndarray:
    """Qwen3-Next's in_proj_qkvz (per key head: q, k, its value heads' v, then their z) from
    attn_qkv [all q; all k; all v] and attn_gate [all z]."""
    nk, nv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    hidden = qkv.shape[-1]
    if qkv.shape[0] != 2 * nk * dk + nv * dv or z.shape != (nv * dv, hidden):
        raise ValueError(f"attn_qkv {list(qkv.shape)} and attn_gate {list(z.shape)} do not "
                         f"describe one in_proj_qkvz of {nk} key heads of {dk} and {nv} value "
                         f"heads of {dv}")
    q, k, v = np.split(qkv, [nk * dk, 2 * nk * dk])
    per_head = [part.reshape(nk, -1, hidden) for part in (q, k, v, z)]
    return np.concatenate(per_head, axis=1).reshape(-1, hidden)
