"""Load config and float32 weights from a GGUF file (llama, qwen2, qwen3, deepseek2, and the
Gated DeltaNet hybrids qwen3next, qwen35, qwen35moe)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PretrainedConfig

from shoal.loader.gguf_config import build_gguf_config, gguf_architecture
from shoal.loader.gguf_dequant import dequantize
from shoal.loader.gguf_file import GGUFFile, GGUFTensor, open_gguf
from shoal.loader.gguf_hybrid import join_qkvz, restore_tensor
from shoal.loader.gguf_names import (
    EXPERT_PROJECTIONS,
    HYBRID_ARCHITECTURES,
    KV_B_PARTS,
    QKVZ_PARTS,
    block_of,
    expert_tensor_name,
    hf_tensor_name,
    layer_tensor,
)
from shoal.loader.loaded_model import WeightsFn, no_weights


@dataclass(frozen=True)
class TensorPlan:
    """How GGUF tensors become transformers tensors: one tensor renamed (llama's q/k rows
    un-permuted, a hybrid's conversion undone), a stacked-experts tensor split into one tensor
    per expert and projection, DeepSeek's attn_k_b + attn_v_b joined into kv_b_proj,
    Qwen3-Next's attn_qkv + attn_gate into in_proj_qkvz, or zeros for a tensor llama.cpp
    treats as optional."""

    hf_name: str
    tensor: GGUFTensor | None = None
    unpermute_heads: int | None = None  # head count to undo llama.cpp's rotary row permutation
    # stacked experts [experts, rows, cols]: the projections one expert's rows hold, in order
    expert_projections: tuple[str, ...] = ()
    layer: int = -1  # of the stacked experts
    v_b: GGUFTensor | None = None  # set when `tensor` is attn_k_b: the two become kv_b_proj
    z: GGUFTensor | None = None  # set when `tensor` is attn_qkv: the two become in_proj_qkvz
    zeros: int = 0  # the length of a zero vector to yield instead of a tensor
    restore: str = ""  # the hybrid architecture whose conversion to undo (gguf_hybrid.py)


@dataclass
class GGUFModel:
    file: GGUFFile
    config: PretrainedConfig
    weights: WeightsFn


def load_gguf(path: str | Path, *, with_weights: bool = True) -> GGUFModel:
    """Parse header and config now; tensors are dequantized only when `weights()` is iterated.

    Without weights (dummy loads) the tensors are not even checked, so any file whose metadata
    describes a supported architecture works.
    """
    gguf = open_gguf(path)
    config = build_gguf_config(gguf)
    if not with_weights:
        return GGUFModel(file=gguf, config=config, weights=no_weights)
    plans = plan_tensors(gguf, config)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for plan in plans:
            yield from _materialize(gguf, plan, config)

    return GGUFModel(file=gguf, config=config, weights=weights)


def plan_tensors(gguf: GGUFFile, config: PretrainedConfig) -> list[TensorPlan]:
    # Names are checked up front so an unsupported file fails at load time, not mid-iteration.
    arch = gguf_architecture(gguf)
    hybrid = gguf.architecture if gguf.architecture in HYBRID_ARCHITECTURES else ""
    plans = []
    kv_b_parts: dict[int, dict[str, GGUFTensor]] = {}
    qkvz_parts: dict[int, dict[str, GGUFTensor]] = {}
    for tensor in gguf.tensors:
        if hybrid and block_of(tensor.name) >= config.num_hidden_layers:
            continue  # Qwen3.5's MTP blocks (gguf_hybrid.mtp_blocks)
        parsed = layer_tensor(tensor.name)
        if parsed is not None and parsed.kind == "weight":
            if parsed.part in EXPERT_PROJECTIONS:
                plans.append(_expert_plan(gguf, tensor, parsed.layer, parsed.part))
                continue
            if parsed.part in KV_B_PARTS:
                kv_b_parts.setdefault(parsed.layer, {})[parsed.part] = tensor
                continue
            if hybrid == "qwen3next" and parsed.part in QKVZ_PARTS:
                qkvz_parts.setdefault(parsed.layer, {})[parsed.part] = tensor
                continue
        try:
            hf_name = hf_tensor_name(tensor.name, gguf.architecture)
        except KeyError:
            raise ValueError(
                f"GGUF file {gguf.path} has tensor {tensor.name!r}, which shoal cannot map to a "
                f"{gguf.architecture} parameter"
            ) from None
        if hf_name is None:
            continue
        heads = None
        if arch.permuted_qk and ".self_attn.q_proj." in hf_name:
            heads = config.num_attention_heads
        elif arch.permuted_qk and ".self_attn.k_proj." in hf_name:
            heads = config.num_key_value_heads
        plans.append(TensorPlan(hf_name=hf_name, tensor=tensor, unpermute_heads=heads,
                                restore=hybrid))
    for layer, parts in sorted(qkvz_parts.items()):
        if len(parts) != len(QKVZ_PARTS):
            raise ValueError(f"GGUF file {gguf.path} has {' and '.join(sorted(parts))} but not "
                             f"its partner in layer {layer}; in_proj_qkvz needs both")
        plans.append(TensorPlan(hf_name=f"model.layers.{layer}.linear_attn.in_proj_qkvz.weight",
                                tensor=parts["attn_qkv"], z=parts["attn_gate"]))
    planned = {plan.hf_name for plan in plans}
    for layer, parts in sorted(kv_b_parts.items()):
        hf_name = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        if hf_name in planned:
            continue  # the file also has the unsplit attn_kv_b
        if len(parts) != len(KV_B_PARTS):
            raise ValueError(f"GGUF file {gguf.path} has {' and '.join(sorted(parts))} but not "
                             f"its partner in layer {layer}; kv_b_proj needs both")
        plans.append(TensorPlan(hf_name=hf_name, tensor=parts["attn_k_b"],
                                v_b=parts["attn_v_b"]))
    plans.extend(_missing_score_biases(config, planned))
    return plans


def _expert_plan(gguf: GGUFFile, tensor: GGUFTensor, layer: int, part: str) -> TensorPlan:
    projections = EXPERT_PROJECTIONS[part]
    shape = [int(d) for d in tensor.shape.tolist()]  # cols, rows, experts (fastest first)
    if len(shape) != 3 or shape[1] % len(projections):
        raise ValueError(f"GGUF file {gguf.path} has expert tensor {tensor.name!r} of shape "
                         f"{shape}; expected [cols, rows, experts] with rows divisible by "
                         f"{len(projections)}")
    return TensorPlan(hf_name=f"model.layers.{layer}.mlp.experts", tensor=tensor,
                      expert_projections=projections, layer=layer)


def _missing_score_biases(config: PretrainedConfig, planned: set[str]) -> list[TensorPlan]:
    """DeepSeek-V3 routing without exp_probs_b in the file: llama.cpp then adds no bias, so
    the model's e_score_correction_bias is zero."""
    if getattr(config, "model_type", None) != "deepseek_v3" or not config.n_routed_experts:
        return []
    plans = []
    for layer in range(config.first_k_dense_replace or 0, config.num_hidden_layers):
        name = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        if name not in planned:
            plans.append(TensorPlan(hf_name=name, zeros=int(config.n_routed_experts)))
    return plans


def dequantize_tensor(tensor: GGUFTensor) -> np.ndarray:
    """Float32 values in transformers layout: (out_features, in_features) for matrices; a fresh
    writable array, so torch can take it without a copy."""
    values = dequantize(tensor.data, tensor.tensor_type)
    # GGUF lists dimensions fastest-first (ne0 = in_features), the reverse of torch's order
    shape = tuple(int(dim) for dim in reversed(tensor.shape.tolist()))
    return values.reshape(shape)


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permutation.

    llama.cpp's converter interleaves the two rotary halves of every head (rows r and r + d/2 end
    up adjacent) because ggml's rope pairs neighbouring elements; transformers rotates halves.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    grouped = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """DeepSeek's kv_b_proj [heads * (qk_nope + v_head_dim), kv_lora_rank] from llama.cpp's
    attn_k_b [heads, kv_lora_rank, qk_nope] (each head's slice transposed) and attn_v_b
    [heads, v_head_dim, kv_lora_rank]."""
    if k_b.ndim != 3 or v_b.ndim != 3 or v_b.shape[0] != k_b.shape[0] \
            or v_b.shape[2] != k_b.shape[1]:
        raise ValueError(f"attn_k_b {list(k_b.shape)} and attn_v_b {list(v_b.shape)} do not "
                         f"describe one kv_b_proj ([heads, kv_lora_rank, qk_nope] and "
                         f"[heads, v_head_dim, kv_lora_rank])")
    kv_lora_rank = k_b.shape[1]
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, kv_lora_rank)


def _materialize(gguf: GGUFFile, plan: TensorPlan, config: PretrainedConfig
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    if plan.zeros:
        yield plan.hf_name, torch.zeros(plan.zeros, dtype=torch.float32)
        return
    tensor = plan.tensor
    assert tensor is not None
    if plan.expert_projections:
        yield from _split_experts(gguf, plan)
        return
    values = _dequantize(gguf, tensor)
    if plan.v_b is not None:
        try:
            values = join_kv_b(values, _dequantize(gguf, plan.v_b))
        except ValueError as exc:
            raise ValueError(f"GGUF file {gguf.path}: {exc}") from None
    try:
        if plan.z is not None:
            values = join_qkvz(values, _dequantize(gguf, plan.z), config)
        if plan.restore:
            values = restore_tensor(plan.hf_name, values, config, plan.restore)
    except ValueError as exc:
        raise ValueError(f"GGUF file {gguf.path}: {exc}") from None
    if plan.unpermute_heads is not None:
        values = unpermute_qk(values, plan.unpermute_heads)
    yield plan.hf_name, _to_torch(values)


def _split_experts(gguf: GGUFFile, plan: TensorPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """One expert at a time (quantized rows are per expert), so only one expert's float32
    values exist at once: a DeepSeek-V3 layer's stacked tensor is 15 GB in float32."""
    tensor = plan.tensor
    assert tensor is not None
    cols, rows, experts = (int(d) for d in tensor.shape.tolist())
    for expert in range(experts):
        values = _dequantize(gguf, tensor, tensor.data[expert]).reshape(rows, cols)
        parts = np.split(values, len(plan.expert_projections), axis=0)
        for projection, part in zip(plan.expert_projections, parts):
            yield expert_tensor_name(plan.layer, expert, projection), _to_torch(part)


def _dequantize(gguf: GGUFFile, tensor: GGUFTensor, data: np.ndarray | None = None
                ) -> np.ndarray:
    try:
        if data is not None:
            return dequantize(data, tensor.tensor_type)
        return dequantize_tensor(tensor)
    except Exception as exc:  # NotImplementedError for exotic types, numpy errors for bad bytes
        raise ValueError(
            f"cannot dequantize tensor {tensor.name!r} ({tensor.tensor_type.name}) in "
            f"{gguf.path}: {exc}"
        ) from exc


def _to_torch(values: np.ndarray) -> torch.Tensor:
    # dequantize's arrays are taken as they are; joined or un-permuted ones are copies already
    if values.dtype != np.float32 or not values.flags.writeable or not values.flags.c_contiguous:
        values = np.array(values, dtype=np.float32, order="C")
    return torch.from_numpy(values)
