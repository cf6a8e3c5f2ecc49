"""Rotary position embedding (neox layout: the two halves of each head are rotated as pairs)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from shoal.layers.ops import cpu_layer_ops
from shoal.layers.ops.dispatch import use_triton
from shoal.layers.rotary_share import RotaryShare


def _rope_kind(scaling: dict[str, Any]) -> str:
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_parameters(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either the transformers 4 (`rope_theta`, `rope_scaling`) or the
    transformers 5 (`rope_parameters`) spelling of a config.

    For llama3, yarn and longrope, a missing `original_max_position_embeddings` is filled in as
    transformers' standardize_rope_params does: the config's own
    `original_max_position_embeddings` attribute if it has one (it wins over the dict's, as in
    transformers), else its `max_position_embeddings`. A longrope without a `factor` gets
    max_position_embeddings / original_max_position_embeddings, as transformers derives it."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        kind = params.get("rope_type", "default")
        scaling = None if kind == "default" else dict(params)
    else:
        theta = float(getattr(hf_config, "rope_theta", 10000.0))
        scaling = getattr(hf_config, "rope_scaling", None)
        if scaling and _rope_kind(scaling) == "default":
            scaling = None
    if scaling and _rope_kind(scaling) in ("llama3", "yarn", "longrope"):
        original = getattr(hf_config, "original_max_position_embeddings", None)
        if original is None and "original_max_position_embeddings" not in scaling:
            original = getattr(hf_config, "max_position_embeddings", None)
        if original is not None:
            scaling = {**scaling, "original_max_position_embeddings": original}
    if scaling and _rope_kind(scaling) == "longrope" and scaling.get("factor") is None:
        longest = getattr(hf_config, "max_position_embeddings", None)
        if longest is not None:
            scaling = {**scaling,
                       "factor": longest / scaling["original_max_position_embeddings"]}
    return theta, scaling


def _yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_scale(scaling: dict[str, Any] | None, base_scale: float) -> float:
    """The attention softmax scale of a DeepSeek model (`base_scale` is usually
    qk_head_dim ** -0.5): multiplied by get_mscale(factor, mscale_all_dim) squared when the
    rope scaling sets a nonzero mscale_all_dim, as transformers' yarn_apply_mscale does. The
    cos/sin table then carries get_mscale(factor, mscale) / get_mscale(factor,
    mscale_all_dim) (see _yarn), so q.k is scaled by mscale(factor, mscale) ** 2 overall."""
    if not scaling or _rope_kind(scaling) == "default":
        return base_scale
    mscale_all_dim = scaling.get("mscale_all_dim", 0)
    if not mscale_all_dim:
        return base_scale
    if scaling.get("factor") is None:
        raise ValueError("rope scaling with mscale_all_dim needs a factor")
    mscale = _yarn_get_mscale(scaling["factor"], mscale_all_dim)
    return base_scale * mscale * mscale


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
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: linear, llama3, "
                     "yarn, longrope)")


def _yarn(rot_dim: int, theta: float, scaling: dict[str, Any],
          max_position: int | None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention factor) as transformers' _compute_yarn_parameters computes them,
    in float32 and in the same order (so the frequencies are its own, bit for bit); the
    attention factor multiplies cos and sin. With factor None the factor is max_position /
    original_max_position_embeddings, as transformers takes it from max_position_embeddings."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor")
    if factor is None:
        if max_position is None:
            raise ValueError("yarn scaling without a factor needs max_position")
        factor = max_position / original
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = float(_yarn_get_mscale(factor, mscale)
                              / _yarn_get_mscale(factor, mscale_all_dim))
        else:
            attention = _yarn_get_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` times into the original context.
        return (rot_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    cpu = torch.device("cpu")
    ramp = ((torch.arange(rot_dim // 2, dtype=torch.float32, device=cpu) - low)
            / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency, 0: interpolate by the factor
    pos_freqs = theta ** (torch.arange(0, rot_dim, 2, device=cpu).to(torch.float32) / rot_dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv.double(), float(attention)


def _longrope(rot_dim: int, theta: float, scaling: dict[str, Any],
              max_position: int | None) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention factor) of LongRoPE (Phi-3.5, Phi-4-mini): each frequency divided
    by its own factor, computed in float32 as transformers' _compute_longrope_parameters does.
    transformers switches from short_factor to long_factor once a sequence grows past
    original_max_position_embeddings (recomputing its cache); a paged cache cannot re-rotate
    the keys it holds, so the set is chosen once for the context the table covers
    (max_position), as vLLM chooses it from max_model_len: long_factor past the original
    context, short_factor within it. The attention factor (on cos and sin) is the config's,
    else sqrt(1 + ln(factor) / ln(original)) for a factor above 1."""
    original = scaling["original_max_position_embeddings"]
    use_long = max_position is not None and max_position > original
    key = "long_factor" if use_long else "short_factor"
    ext = scaling.get(key)
    if not isinstance(ext, (list, tuple)) or len(ext) != rot_dim // 2:
        raise ValueError(f"longrope {key} must be a list of {rot_dim // 2} numbers (half the "
                         f"rotary dims), got {ext!r}")
    factor = scaling.get("factor")
    if factor is None:
        factor = (max_position or original) / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = (1.0 if factor <= 1.0
                     else math.sqrt(1 + math.log(factor) / math.log(original)))
    cpu = torch.device("cpu")
    exponent = torch.arange(0, rot_dim, 2, dtype=torch.int64, device=cpu).float() / rot_dim
    inv = 1.0 / (torch.tensor(ext, dtype=torch.float32, device=cpu) * theta ** exponent)
    return inv.double(), float(attention)


def _rope_freqs(rot_dim: int, theta: float, scaling: dict[str, Any] | None,
                max_position: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [rot_dim / 2] float64, attention factor multiplying cos and sin)."""
    if scaling and _rope_kind(scaling) == "yarn":
        return _yarn(rot_dim, theta, scaling, max_position)
    if scaling and _rope_kind(scaling) == "longrope":
        return _longrope(rot_dim, theta, scaling, max_position)
    return _inv_freq(rot_dim, theta, scaling), 1.0


def _table_length(max_position: int, scaling: dict[str, Any] | None) -> int:
    """Positions the table covers: max_position, and for yarn at least
    original_max_position_embeddings * factor, the context the scaling extends to (DeepSeek
    configs already give that as max_position_embeddings; others keep the pre-yarn length)."""
    if scaling and _rope_kind(scaling) == "yarn" and scaling.get("factor") is not None:
        extended = int(scaling["original_max_position_embeddings"] * scaling["factor"])
        return max(max_position, extended)
    return max_position


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None, rot_dim: int | None = None,
                 use_triton_ops: bool = True):
        super().__init__()
        self.head_dim = head_dim
        self.use_triton_ops = use_triton_ops  # the Triton kernel for CUDA tensors
        self.rot_dim = rot_dim or head_dim
        inv, self.attention_factor = _rope_freqs(self.rot_dim, theta, scaling, max_position)
        self.max_position = _table_length(max_position, scaling)
        t = torch.arange(self.max_position, dtype=torch.float64)
        freqs = torch.outer(t, inv.to(t.device))
        # [max_position, rot_dim]: cos then sin, computed in float64 once for accuracy; yarn's
        # attention factor is baked in, so every reader of the table applies it.
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        if self.attention_factor != 1.0:
            cache = cache * self.attention_factor
        cache = cache.float()
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; returns them rotated: in place on CUDA and through
        the CPU's C++ kernel, as rotated copies on the torch path."""
        if use_triton(q, self.use_triton_ops):
            from shoal.layers.ops.rotary import rotary_embedding

            return rotary_embedding(positions, q, k, self.cos_sin_cache)
        if (q.dim() == 3 and k.dim() == 3 and k.dtype == q.dtype and q.stride(-1) == 1
                and k.stride(-1) == 1 and positions.dtype == torch.int64
                and cpu_layer_ops.usable(q)):
            cpu_layer_ops.rotary_embedding(positions.contiguous(), q, k, self.cos_sin_cache,
                                           self.rot_dim)
            return q, k
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


_SHARED: RotaryShare[RotaryEmbedding] = RotaryShare()  # (rotary_share.py: one model's)


def _freeze(value: Any) -> Any:
    """A hashable stand-in for a scaling dict: dicts become key-sorted tuples and lists tuples,
    at any depth, so equal settings share one module whatever their key order."""
    if isinstance(value, dict):
        return ("dict", tuple(sorted((str(k), _freeze(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("seq", tuple(_freeze(v) for v in value))
    return value


def get_rope(head_dim: int, max_position: int, theta: float,
             scaling: dict[str, Any] | None = None,
             use_triton_ops: bool = True, rot_dim: int | None = None) -> RotaryEmbedding:
    """One rotary module (and one cos/sin table) shared by every layer of a model with the same
    settings (rotary_share.py: never by two models); a long-context model's table is tens of
    MiB, too much to repeat per layer. rot_dim: the
    leading dims of a head that rotate (partial rotary; default all)."""
    device = torch.empty(0).device  # the torch.device context the model is built under
    key = (head_dim, max_position, theta, _freeze(scaling or {}), str(device), use_triton_ops,
           rot_dim)
    return _SHARED.get(key, lambda: RotaryEmbedding(head_dim, max_position, theta, scaling,
                                                    rot_dim=rot_dim,
                                                    use_triton_ops=use_triton_ops))
