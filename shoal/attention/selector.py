"""Which attention backend a run uses: the engine's attention_backend argument, or by default
Triton on CUDA and the torch reference elsewhere. Backends are imported only when chosen."""

from __future__ import annotations

import torch

from shoal.attention.backend import AttentionBackend


def get_attention_backend(device: torch.device, name: str | None = None, *,
                          fuse_rope_kv_write: bool = True) -> AttentionBackend:
    """`name` forces a backend ("torch" or "triton"); by default Triton on CUDA.
    fuse_rope_kv_write=False keeps q/k norm and rotary out of the Triton cache write."""
    name = name or ("triton" if device.type == "cuda" else "torch")
    if name == "torch":
        from shoal.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from shoal.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(fuse_rope_and_cache_write=fuse_rope_kv_write)
    raise ValueError(f"attention backend must be 'torch' or 'triton' (got {name!r})")
