"""Multimodal rotary embedding (M-RoPE, Qwen2-VL onwards): each rotary frequency reads one
of three position streams (time, height, width). An image's tokens get 3-D positions; text
tokens have three equal streams, which is plain rotary at that position, so steps of text
alone take [T] positions through RotaryEmbedding's kernels, and only steps over images run
the [3, T] path here.

mrope_section [s_t, s_h, s_w] (summing to rot_dim / 2) says how many frequencies each stream
owns: in consecutive runs (Qwen2-VL, Qwen2.5-VL), or interleaved t, h, w, t, h, w, ... over
the first 3 * s_h frequencies (Qwen3-VL, Qwen3.5: `mrope_interleaved`)."""

from __future__ import annotations

from typing import Any

import torch

from shoal.layers.rotary import RotaryEmbedding, rope_parameters
from shoal.layers.rotary_share import RotaryShare


def mrope_streams(mrope_section: list[int], interleaved: bool) -> list[int]:
    """The position stream (0 time, 1 height, 2 width) of each rotary frequency."""
    half = sum(mrope_section)
    if not interleaved:
        return [s for s, n in enumerate(mrope_section) for _ in range(n)]
    streams = [0] * half
    for s in (1, 2):
        for j in range(s, min(3 * mrope_section[s], half), 3):
            streams[j] = s
    return streams


class MRotaryEmbedding(RotaryEmbedding):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 mrope_section: list[int], interleaved: bool = False,
                 scaling: dict[str, Any] | None = None, rot_dim: int | None = None,
                 use_triton_ops: bool = True):
        super().__init__(head_dim, max_position, theta, scaling, rot_dim, use_triton_ops)
        if 2 * sum(mrope_section) != self.rot_dim:
            raise ValueError(f"mrope_section {mrope_section} must sum to half the rotary "
                             f"dimension ({self.rot_dim // 2})")
        streams = torch.tensor(mrope_streams(list(mrope_section), interleaved))
        self.register_buffer("streams", streams, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, q, k)
        return self.forward_mrope(positions, q, k)

    def forward_mrope(self, positions: torch.Tensor, q: torch.Tensor,
                      k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [3, T]; q [T, Hq, D], k [T, Hk, D]: rotated copies."""
        half = self.rot_dim // 2
        per_freq = positions[self.streams].t()  # [T, half]: each frequency's position
        cols = torch.arange(half, device=positions.device)
        cos = self.cos_sin_cache[per_freq, cols]
        sin = self.cos_sin_cache[per_freq, cols + half]
        cos2 = torch.cat([cos, cos], -1).unsqueeze(1)
        sin2 = torch.cat([-sin, sin], -1).unsqueeze(1)
        hq = q.shape[1]
        x = torch.cat([q, k], dim=1)
        rot = x[..., : self.rot_dim].float()
        swapped = torch.cat([rot[..., half:], rot[..., :half]], dim=-1)
        out = (rot * cos2 + swapped * sin2).to(x.dtype)
        if self.rot_dim < x.shape[-1]:
            out = torch.cat([out, x[..., self.rot_dim:]], dim=-1)
        return out[:, :hq], out[:, hq:]


def mrope_section_of(hf_config: Any) -> tuple[list[int], bool] | None:
    """(mrope_section, interleaved) from a text config's rope settings; None: plain rotary."""
    rope = (getattr(hf_config, "rope_parameters", None)
            or getattr(hf_config, "rope_scaling", None) or {})
    section = rope.get("mrope_section")
    if not section:
        return None
    return [int(s) for s in section], bool(rope.get("mrope_interleaved", False))


_SHARED: RotaryShare[MRotaryEmbedding] = RotaryShare()  # (rotary_share.py: one model's)


def get_mrope(hf_config: Any, head_dim: int, use_triton_ops: bool = True,
              rot_dim: int | None = None) -> MRotaryEmbedding:
    """The M-RoPE module of a text config that has mrope_section, one per settings and
    device (as get_rope: the cos/sin table of a long context is tens of MiB)."""
    found = mrope_section_of(hf_config)
    if found is None:
        raise ValueError("the config has no mrope_section")
    theta, scaling = rope_parameters(hf_config)
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) in ("default",
                                                                                "mrope"):
        scaling = None
    device = torch.empty(0).device  # the torch.device context the model is built under
    key = (head_dim, hf_config.max_position_embeddings, theta, tuple(found[0]), found[1],
           repr(sorted((scaling or {}).items())), str(device), use_triton_ops, rot_dim)
    return _SHARED.get(key, lambda: MRotaryEmbedding(
        head_dim, hf_config.max_position_embeddings, theta, found[0], found[1], scaling,
        rot_dim, use_triton_ops))
