"""Attention backends: how the model runner builds per-step metadata and how each attention
layer runs over the paged cache. The torch reference runs anywhere; the Triton backend is the
GPU fast path."""

from __future__ import annotations

from typing import Any, Protocol

import torch


class AttentionBackend(Protocol):
    name: str

    def build_metadata(self, *, query_lens: list[int], context_lens: list[int],
                       block_tables: list[list[int]], block_size: int, num_decodes: int,
                       sliding_window: int | None, device: torch.device,
                       null_block: int) -> Any: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, md: Any, scale: float) -> torch.Tensor: ...


class TorchAttentionBackend:
    name = "torch"

    def build_metadata(self, **kwargs: Any) -> Any:
        from shoal.attention.metadata import build_attention_metadata

        return build_attention_metadata(**kwargs)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, md: Any, scale: float) -> torch.Tensor:
        from shoal.attention.torch_backend import paged_attention

        return paged_attention(q, k, v, kv_cache, md, scale)


def get_attention_backend(device: torch.device, name: str | None = None) -> AttentionBackend:
    """`name` forces a backend ("torch" or "triton"); by default Triton on CUDA."""
    name = name or ("triton" if device.type == "cuda" else "torch")
    if name == "torch":
        return TorchAttentionBackend()
    if name == "triton":
        from shoal.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"attention backend must be 'torch' or 'triton' (got {name!r})")
