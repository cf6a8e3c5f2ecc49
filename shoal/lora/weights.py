"""An adapter's tensors, read from its safetensors file into host memory: per checkpoint
module name, A [r, in] and B [out, r] with the LoRA scale folded into B, in the model dtype
(full, unsharded: each rank's layer takes its slice when the adapter enters a slot)."""

from __future__ import annotations

from pathlib import Path

import torch

from shoal.lora.adapter import WEIGHTS_FILE, AdapterSpec

AdapterWeights = dict[str, tuple[torch.Tensor, torch.Tensor]]


def load_adapter_weights(spec: AdapterSpec, dtype: torch.dtype, pin: bool = False
                         ) -> AdapterWeights:
    from safetensors import safe_open

    weights: AdapterWeights = {}
    with safe_open(str(Path(spec.path) / WEIGHTS_FILE), framework="pt") as f:
        for name, mod in spec.modules.items():
            a = f.get_tensor(mod.a_key).to(dtype)
            b = (f.get_tensor(mod.b_key).float() * mod.scaling).to(dtype)
            if pin:
                a, b = a.pin_memory(), b.pin_memory()
            weights[name] = (a, b)
    return weights
