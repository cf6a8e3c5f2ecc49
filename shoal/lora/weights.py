"""An adapter's tensors, read from its safetensors file into host memory: per checkpoint
module name, A [r, in] and B [out, r] with the LoRA scale folded into B, in the model dtype
(full, unsharded: each rank's layer takes its slice when the adapter enters a slot).

The tensors come from the very bytes whose digest matches the spec's (the version the spec's
shapes and scales were read from): a folder saved again between the two reads is an error,
never a mix of two versions."""

from __future__ import annotations

from pathlib import Path

import torch

from shoal.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterSpec
from shoal.lora.adapter_digest import read_verified

AdapterWeights = dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_adapter_weights(spec: AdapterSpec, dtype: torch.dtype, pin: bool = False
                         ) -> AdapterWeights:
    from safetensors.torch import load

    data = read_verified(Path(spec.path), CONFIG_FILE, WEIGHTS_FILE, spec.digest)
    tensors = load(data)
    del data
    weights: AdapterWeights = {}
    for name, mod in spec.modules.items():
        a = tensors[mod.a_key].to(dtype)
        b = scaled(tensors[mod.b_key], mod.scaling, dtype)
        if pin:
            a, b = a.pin_memory(), b.pin_memory()
        weights[name] = (a, b)
    return weights


def scaled(b: torch.Tensor, scaling: float, dtype: torch.dtype) -> torch.Tensor:
    """round_dtype(float32(b) * scaling): B with the LoRA scale folded in. A B already in
    `dtype` is multiplied in it, one pass: torch computes a 16-bit tensor times a scalar in
    float32 and rounds once, the same bits as the float32 round trip (three passes, the
    larger part of a load's host time before)."""
    if b.dtype != dtype:
        return (b.float() * scaling).to(dtype)
    return b if scaling == 1.0 else b.mul(scaling)
