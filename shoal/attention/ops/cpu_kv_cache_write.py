"""The KV cache write on the CPU through shoal's C++ kernel (layer_ops_cpu.cpp, built and
loaded by shoal/cpu_kernels.py; on and off with the layer ops: SHOAL_CPU_LAYER_KERNELS)."""

from __future__ import annotations

import torch

from shoal import cpu_kernels

# Whether the kernel may write k (a CPU tensor of a layer-op dtype, kernels loaded)
usable = cpu_kernels.layer_ops_usable


def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hk, D] into their slots of kv_cache [2, slots, Hk, D]."""
    torch.ops.shoal_cpu.write_kv_cache(kv_cache[0], kv_cache[1], k, v, slot_mapping)
