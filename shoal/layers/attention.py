"""The paged attention layer every model uses: it holds one layer's KV cache and hands the
work to the attention backend. The model runner binds both (`kv_cache` once the pool is
sized, `backend` once at start-up); a fresh layer uses the torch reference backend.

With an FP8 cache (kv_cache_dtype="fp8") the layer hands its per-tensor k and v scales to the
backend: 1.0 unless the checkpoint has them (set at load by shoal/loader/kv_scales.py, from
`self_attn.k_scale` / `v_scale` or the projections' `output_scale`). They are plain floats:
fixed once loaded, read on the host at each launch (a CUDA graph keeps them as constants).
A soft-capped layer (Gemma 2) hands its cap to both forward paths the same way, and refuses
a backend without supports_softcap as soon as the runner binds it: a cap is never dropped."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.attention import kv_quant
from shoal.attention.backend import AttentionBackend
from shoal.attention.metadata import GroupedMetadata
from shoal.attention.packed import PackedSeqs, packed_attention
from shoal.attention.torch_backend import TorchAttentionBackend, causal_attention_with_sinks
from shoal.core.kv_cache_spec import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec
from shoal.layers.norm import RMSNorm
from shoal.layers.rotary import RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int,
                 sliding_window: int | None = None, softcap: float | None = None):
        """softcap: attention scores capped as softcap * tanh(score / softcap) (Gemma 2)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.sliding_window = sliding_window
        self.softcap = softcap or None
        self.kv_cache: torch.Tensor | None = None  # [2, num_slots, Hk, D]
        self.kv_group = 0  # its KV cache group: which of a step's metadata it reads
        self.backend = TorchAttentionBackend()
        self.k_scale, self.v_scale = 1.0, 1.0  # an FP8 cache's scales (kv_quant.py)

    @property
    def backend(self) -> AttentionBackend:
        return self._backend

    @backend.setter
    def backend(self, backend: AttentionBackend) -> None:
        """Binds the backend (the runner does, at start-up); a soft-capped layer refuses one
        that cannot cap, before any step runs."""
        if self.softcap and not backend.supports_softcap:
            raise self._no_softcap(backend)
        self._backend = backend

    @staticmethod
    def _no_softcap(backend: AttentionBackend) -> NotImplementedError:
        return NotImplementedError(f"the {backend.name} attention backend has no attention "
                                   "soft-capping; use attention_backend='torch'")

    def set_kv_scales(self, k_scale: float | None, v_scale: float | None) -> None:
        """The checkpoint's scales of an FP8 KV cache (None: keep 1.0)."""
        if k_scale is not None:
            self.k_scale = kv_quant.check_scale("k_scale", k_scale)
        if v_scale is not None:
            self.v_scale = kv_quant.check_scale("v_scale", v_scale)

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
            if self.softcap:
                raise NotImplementedError("attention soft-capping in a pooling step")
            if sinks is not None:
                return self._packed_with_sinks(q, k, v, md, sinks)
            return packed_attention(q, k, v, md, self.scale)
        cache = self._cache()
        # a backend without supports_sinks (or FP8) need not take those arguments
        kw = self._fp8_scales(cache)
        if sinks is not None:
            self._check_sinks(sinks)
            kw["sinks"] = sinks
        kw.update(self._softcap_kw())
        return self.backend.forward(q, k, v, cache, md, self.scale, **kw)

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
        cache = self._cache()
        args = (q, k, v, positions, rope.cos_sin_cache,
                q_norm.weight if q_norm is not None else None,
                k_norm.weight if k_norm is not None else None,
                eps, cache, md, self.scale)
        kw = self._fp8_scales(cache)
        if sinks is not None:
            self._check_sinks(sinks)
            kw["sinks"] = sinks
        kw.update(self._softcap_kw())
        return self.backend.forward_fused(*args, **kw)

    def _softcap_kw(self) -> dict[str, Any]:
        """The cap for either forward path (checked again here: a backend's flag is a plain
        attribute, and a cap must never be dropped)."""
        if not self.softcap:
            return {}
        if not self.backend.supports_softcap:
            raise self._no_softcap(self.backend)
        return {"softcap": self.softcap}

    def _fp8_scales(self, cache: torch.Tensor) -> dict[str, Any]:
        if not kv_quant.is_fp8(cache):
            return {}
        if not self.backend.supports_fp8_kv_cache:
            raise NotImplementedError(f"the {self.backend.name} attention backend has no FP8 "
                                      "KV cache; use kv_cache_dtype='auto'")
        return {"k_scale": self.k_scale, "v_scale": self.v_scale}

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
