"""The paged attention layer every model uses: it holds one layer's KV cache and hands the
work to the attention backend. The model runner binds both (`kv_cache` once the pool is
sized, `backend` once at start-up); a fresh layer uses the torch reference backend."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.attention.backend import AttentionBackend
from shoal.attention.metadata import GroupedMetadata
from shoal.attention.packed import PackedSeqs, packed_attention
from shoal.attention.torch_backend import TorchAttentionBackend, causal_attention_with_sinks
from shoal.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from shoal.layers.norm import RMSNorm
from shoal.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.sliding_window = sliding_window
        self.kv_cache: torch.Tensor | None = None  # [2, num_slots, Hk, D]
        self.kv_group = 0  # its KV cache group: which of a step's metadata it reads
        self.backend: AttentionBackend = TorchAttentionBackend()

    def kv_cache_spec(self, dtype_bytes: int) -> KVCacheSpec:
        """What it keeps per token: a K and a V row of Hk x D, of the whole context or of the
        last sliding_window tokens."""
        if self.sliding_window is None:
            return FullAttentionSpec(self.num_kv_heads, self.head_dim, dtype_bytes)
        return SlidingWindowSpec(self.num_kv_heads, self.head_dim, dtype_bytes,
                                 self.sliding_window)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, md: Any,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """sinks [num_heads]: a learned logit per query head in the softmax's denominator
        (gpt-oss), or None."""
        if isinstance(md, GroupedMetadata):
            md = md.of(self.kv_group)
        if isinstance(md, PackedSeqs):  # a pooling step: no KV cache, whole prompts (the
            # compatibility table keeps them within a sliding window, which this does not apply)
            if sinks is not None:
                return self._packed_with_sinks(q, k, v, md, sinks)
            return packed_attention(q, k, v, md, self.scale)
        if sinks is None:  # a backend without supports_sinks need not take the argument
            return self.backend.forward(q, k, v, self._cache(), md, self.scale)
        self._check_sinks(sinks)
        return self.backend.forward(q, k, v, self._cache(), md, self.scale, sinks=sinks)

    @property
    def fuses_rope(self) -> bool:
        """Whether the backend applies q/k norm and rotary itself (forward_rope)."""
        return self.backend.fuses_rope_and_cache_write

    def forward_rope(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, rope: RotaryEmbedding, q_norm: RMSNorm | None,
                     k_norm: RMSNorm | None, md: Any,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
        """forward on q and k before the optional per-head norms and the rotary, which the
        backend fuses into its cache write (only while fuses_rope). q is modified in place."""
        if isinstance(md, GroupedMetadata):
            md = md.of(self.kv_group)
        norms = [n for n in (q_norm, k_norm) if n is not None]
        if len({n.eps for n in norms}) > 1:
            raise ValueError("the fused kernel takes one eps for the q and k norms")
        eps = norms[0].eps if norms else 0.0
        args = (q, k, v, positions, rope.cos_sin_cache,
                q_norm.weight if q_norm is not None else None,
                k_norm.weight if k_norm is not None else None,
                eps, self._cache(), md, self.scale)
        if sinks is None:
            return self.backend.forward_fused(*args)
        self._check_sinks(sinks)
        return self.backend.forward_fused(*args, sinks=sinks)

    def _packed_with_sinks(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           md: PackedSeqs, sinks: torch.Tensor) -> torch.Tensor:
        """A pooling step of a causal model with sinks: each prompt on its own."""
        if not md.causal:
            raise NotImplementedError("attention sinks in a bidirectional encoder")
        out, start = torch.empty_like(q), 0
        for n in md.seq_lens:
            out[start:start + n] = causal_attention_with_sinks(
                q[start:start + n], k[start:start + n], v[start:start + n], self.scale, sinks)
            start += n
        return out

    def _check_sinks(self, sinks: torch.Tensor) -> None:
        if not self.backend.supports_sinks:
            raise NotImplementedError(f"the {self.backend.name} attention backend has no "
                                      "attention sinks (gpt-oss); use attention_backend='torch'")
        if sinks.shape != (self.num_heads,):
            raise ValueError(f"sinks must be [{self.num_heads}], got {tuple(sinks.shape)}")

    def _cache(self) -> torch.Tensor:
        if self.kv_cache is None:
            raise RuntimeError("KV cache is not bound to the attention layer")
        return self.kv_cache
