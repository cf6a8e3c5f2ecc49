"""DeepSeek-V4's rotary embedding: the trailing rot_dim channels of a head ([nope | rope])
rotate as consecutive pairs (x0, x1), (x2, x3), ... A plain-torch module of its own (shoal's
RotaryEmbedding rotates halves, and V4 could not permute weights into that layout: its keys
are also its values, and its attention output is rotated back).

V4 has two tables: "main" (sliding-only layers: plain RoPE) and "compress" (CSA/HCA layers,
their compressors and indexer: another theta, with YaRN), both from config.rope_parameters.
The frequencies are transformers' own (shoal.layers.rotary computes them in its order); cos
and sin are computed per step in float32 from positions, as transformers does."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.layers.rotary import _rope_freqs


def rope_dim(cfg: Any) -> int:
    """The rotated channels of a head: qk_rope_head_dim, or head_dim x partial_rotary_factor."""
    dim = getattr(cfg, "qk_rope_head_dim", None)
    return int(dim) if dim else int(cfg.head_dim * cfg.partial_rotary_factor)


class InterleavedRope(nn.Module):
    def __init__(self, cfg: Any, kind: str):
        """kind: "main" or "compress", a key of cfg.rope_parameters."""
        super().__init__()
        params = dict(cfg.rope_parameters[kind])
        self.rot_dim = rope_dim(cfg)
        scaling = None if params.get("rope_type", "default") == "default" else params
        inv, self.attention_factor = _rope_freqs(self.rot_dim, float(params["rope_theta"]),
                                                 scaling, cfg.max_position_embeddings)
        # on the device the model is built under (a copy from the CPU each step would be
        # refused inside a CUDA graph capture)
        self.register_buffer("inv_freq", inv.float().to(torch.empty(0).device),
                             persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] -> cos, sin [T, rot_dim / 2] (float32), one per pair."""
        freqs = positions[:, None].float() * self.inv_freq
        return freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               inverse: bool = False) -> torch.Tensor:
        """x [T, ..., D] rotated by each token's angles (inverse: by their negatives, which
        undoes the rotation), in float32, returned in x's dtype."""
        extra = x.dim() - cos.dim()
        cos = cos.view(cos.shape[0], *(1,) * extra, cos.shape[-1])
        sin = sin.view(sin.shape[0], *(1,) * extra, sin.shape[-1])
        if inverse:
            sin = -sin
        nope, rope = x[..., :-self.rot_dim], x[..., -self.rot_dim:].float()
        even, odd = rope[..., 0::2], rope[..., 1::2]
        rotated = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1)
        return torch.cat([nope, rotated.flatten(-2).to(x.dtype)], dim=-1)
