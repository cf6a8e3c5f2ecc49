"""The paged attention layer of multi-head latent attention (DeepSeek-V2/V3 MLA): it holds one
layer's latent cache and hands the work to the attention backend's forward_mla.

The cache has one plane, [1, num_slots, 1, Dk]: per token the compressed KV latent
(kv_lora_rank values) and the rotated shared key part (qk_rope_head_dim), Dk = 576 for
DeepSeek-V3, once per token rather than per head. The model projects queries into the latent
space (the weight-absorbed form) before calling it, and projects the output back.

An FP8 cache (kv_cache_dtype="fp8") keeps the row with one scale: the checkpoint's k_scale
of the layer when it has one (shoal/loader/kv_scales.py), else 1.0."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.attention import kv_quant
from shoal.attention.backend import AttentionBackend
from shoal.attention.metadata import GroupedMetadata
from shoal.attention.torch_backend import TorchAttentionBackend
from shoal.core.kv_cache_spec import LatentAttentionSpec


class LatentAttention(nn.Module):
    num_kv_heads = 1  # every query head reads the same latent row
    sliding_window = None
    fuses_rope = False
    kv_group = 0

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.v_dim = kv_lora_rank
        self.head_dim = kv_lora_rank + rope_dim  # the width of one cached row
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None  # [1, num_slots, 1, head_dim]
        self.backend: AttentionBackend = TorchAttentionBackend()
        self.kv_scale = 1.0  # an FP8 cache's scale of the latent row (kv_quant.py)

    def set_kv_scales(self, k_scale: float | None, v_scale: float | None) -> None:
        """The checkpoint's scale of an FP8 latent cache: its k_scale (the row is the key;
        a v_scale, if any, is not used: the value is part of the same row)."""
        if k_scale is not None:
            self.kv_scale = kv_quant.check_scale("k_scale", k_scale)

    def kv_cache_spec(self, dtype_bytes: int) -> LatentAttentionSpec:
        """One latent row per token, no separate V plane."""
        return LatentAttentionSpec(1, self.head_dim, dtype_bytes)

    def forward(self, q: torch.Tensor, latent: torch.Tensor, md: Any,
                select: Any = None) -> torch.Tensor:
        """q [T, H, Dk] (absorbed queries), latent [T, Dk] (this step's rows to cache);
        select: the rows each query reads (DeepSeek-V3.2's indexer; None: all it may see).
        Returns [T, H, kv_lora_rank]."""
        if isinstance(md, GroupedMetadata):  # a hybrid: its own KV cache group's
            md = md.of(self.kv_group)
        if not self.backend.supports_mla:
            raise NotImplementedError(f"the {self.backend.name} attention backend has no "
                                      "latent attention (MLA)")
        if self.kv_cache is None:
            raise RuntimeError("KV cache is not bound to the attention layer")
        kw: dict[str, Any] = {}
        if kv_quant.is_fp8(self.kv_cache):
            if not self.backend.supports_fp8_kv_cache:
                raise NotImplementedError(f"the {self.backend.name} attention backend has no "
                                          "FP8 KV cache; use kv_cache_dtype='auto'")
            kw["kv_scale"] = self.kv_scale
        if select is None:
            return self.backend.forward_mla(q, latent, self.kv_cache, md, self.scale, self.v_dim,
                                            **kw)
        if not self.backend.supports_sparse_mla:
            raise NotImplementedError(
                f"the {self.backend.name} attention backend has no sparse latent attention: "
                "DeepSeek-V3.2 contexts longer than index_topk need attention_backend 'torch' "
                "or 'triton'")
        return self.backend.forward_mla(q, latent, self.kv_cache, md, self.scale, self.v_dim,
                                        select, **kw)
