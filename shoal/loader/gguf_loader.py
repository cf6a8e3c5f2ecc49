"""Load config and float32 weights from a GGUF file (llama, qwen2, qwen3)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import ReaderTensor
from gguf.quants import dequantize
from transformers import PretrainedConfig

from shoal.loader.gguf_config import build_gguf_config, gguf_architecture
from shoal.loader.gguf_file import GGUFFile, open_gguf
from shoal.loader.gguf_names import hf_tensor_name
from shoal.loader.loaded_model import WeightsFn, no_weights


@dataclass(frozen=True)
class TensorPlan:
    """How one GGUF tensor becomes one transformers parameter."""

    tensor: ReaderTensor
    hf_name: str
    unpermute_heads: int | None  # head count to undo llama.cpp's rotary row permutation with


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
            yield plan.hf_name, _materialize(gguf, plan)

    return GGUFModel(file=gguf, config=config, weights=weights)


def plan_tensors(gguf: GGUFFile, config: PretrainedConfig) -> list[TensorPlan]:
    # Names are checked up front so an unsupported file fails at load time, not mid-iteration.
    arch = gguf_architecture(gguf)
    plans = []
    for tensor in gguf.reader.tensors:
        try:
            hf_name = hf_tensor_name(tensor.name)
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
        plans.append(TensorPlan(tensor=tensor, hf_name=hf_name, unpermute_heads=heads))
    return plans


def dequantize_tensor(tensor: ReaderTensor) -> np.ndarray:
    """Float32 values in transformers layout: (out_features, in_features) for matrices."""
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


def _materialize(gguf: GGUFFile, plan: TensorPlan) -> torch.Tensor:
    tensor = plan.tensor
    try:
        values = dequantize_tensor(tensor)
    except Exception as exc:  # NotImplementedError for exotic types, numpy errors for bad bytes
        raise ValueError(
            f"cannot dequantize tensor {tensor.name!r} ({tensor.tensor_type.name}) in "
            f"{gguf.path}: {exc}"
        ) from exc
    if plan.unpermute_heads is not None:
        values = unpermute_qk(values, plan.unpermute_heads)
    # F32 tensors come back as read-only views of the memmap; torch needs its own writable copy
    if values.dtype != np.float32 or not values.flags.writeable or not values.flags.c_contiguous:
        values = np.array(values, dtype=np.float32, order="C")
    return torch.from_numpy(values)
