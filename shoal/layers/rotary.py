"""Rotary position embedding (neox layout: the two halves of each head are rotated as pairs)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from shoal.layers.ops.dispatch import use_triton


def rope_parameters(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the transformers 4 (`rope_theta`, `rope_scaling`) or the
    transformers 5 (`rope_parameters`) spelling of a config."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        kind = params.get("rope_type", "default")
        return theta, (None if kind == "default" else dict(params))
    theta = float(getattr(hf_config, "rope_theta", 10000.0))
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


def _inv_freq(rot_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float64) / rot_dim))
    if not scaling:
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        low_wl, high_wl = old_len / low, old_len / high
        smooth = (old_len / wavelen - low) / (high - low)
        scaled = torch.where(wavelen > low_wl, inv / factor, inv)
        mid = (wavelen <= low_wl) & (wavelen >= high_wl)
        return torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None, rot_dim: int | None = None,
                 use_triton_ops: bool = True):
        super().__init__()
        self.head_dim = head_dim
        self.use_triton_ops = use_triton_ops  # the Triton kernel for CUDA tensors
        self.rot_dim = rot_dim or head_dim
        inv = _inv_freq(self.rot_dim, theta, scaling)
        t = torch.arange(max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv)
        # [max_position, rot_dim]: cos then sin, computed in float64 once for accuracy.
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).float()
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; returns rotated copies (rotated in place on CUDA)."""
        if use_triton(q, self.use_triton_ops):
            from shoal.layers.ops.rotary import rotary_embedding

            return rotary_embedding(positions, q, k, self.cos_sin_cache)
        return self.forward_native(positions, q, k)

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # q and k rotate together, as out = x * [cos, cos] + [x2, x1] * [-sin, sin]: half the
        # small ops of rotating each (a batch-1 CPU step is dominated by op count).
        table = self._native_table()[positions].unsqueeze(1)  # [T, 1, 2, rot]
        hq = q.shape[1]
        x = torch.cat([q, k], dim=1)
        rot = x[..., : self.rot_dim].float()
        half = self.rot_dim // 2
        swapped = torch.cat([rot[..., half:], rot[..., :half]], dim=-1)
        out = (rot * table[:, :, 0] + swapped * table[:, :, 1]).to(x.dtype)
        if self.rot_dim < x.shape[-1]:
            out = torch.cat([out, x[..., self.rot_dim:]], dim=-1)
        return out[:, :hq], out[:, hq:]

    def _native_table(self) -> torch.Tensor:
        """[max_pos, 2, rot_dim]: cos of both halves, then (-sin, sin); built on first use."""
        table = getattr(self, "_table", None)
        if table is None:
            cos, sin = self.cos_sin_cache.chunk(2, dim=-1)
            table = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], dim=1)
            self._table = table
        return table


_SHARED: dict[tuple, RotaryEmbedding] = {}


def get_rope(head_dim: int, max_position: int, theta: float,
             scaling: dict[str, Any] | None = None,
             use_triton_ops: bool = True) -> RotaryEmbedding:
    """One rotary module (and one cos/sin table) shared by every layer with the same settings;
    a long-context model's table is tens of MiB, too much to repeat per layer."""
    device = torch.empty(0).device  # the torch.device context the model is built under
    key = (head_dim, max_position, theta, repr(sorted((scaling or {}).items())), str(device),
           use_triton_ops)
    rope = _SHARED.get(key)
    if rope is None:
        rope = _SHARED[key] = RotaryEmbedding(head_dim, max_position, theta, scaling,
                                              use_triton_ops=use_triton_ops)
    return rope
