"""The Qwen2.5-VL vision tower: 14x14x2 patches, 2-D rotary over (h, w), window attention in
all blocks but a few full-attention ones, and a merger that folds 2x2 patches into one token.

Parameter names and shapes match transformers' `model.visual`, so checkpoint tensors under
`visual.` (or `model.visual.`) load as they are once that prefix is stripped."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


@dataclass
class _Segments:
    """One attention layout (windows, or whole frames): contiguous runs of the sequence that
    attend only among themselves. `pad_index` is None when every run has the same length,
    so the sequence is a plain [count, max_len] view and SDPA needs no mask."""

    count: int
    max_len: int
    pad_index: torch.Tensor | None = None  # [count, max_len] rows; padding points at row 0
    key_mask: torch.Tensor | None = None  # [count, 1, 1, max_len] True on real keys
    valid: torch.Tensor | None = None  # positions of the real rows in the padded count*max_len


@dataclass
class _Plan:
    """Everything that depends on grid_thw alone, built once per forward on the host."""

    window_index: torch.Tensor  # [n_units] merge units in the order the blocks see them
    reverse: torch.Tensor  # inverse of window_index, undone on the merged output
    positions: torch.Tensor  # [n_patches, 2] (h, w) of each patch, in window order
    inv_freq: torch.Tensor  # [head_dim // 4] rotary frequencies, shared by h and w
    windows: _Segments
    frames: _Segments


class _RMSNorm(nn.Module):
    def __init__(self, size: int, dtype: torch.dtype, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in fp32, scale applied after the cast back, as the checkpoint was trained
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class _PatchEmbed(nn.Module):
    """A Conv3d whose kernel equals its stride and its input: i.e. a linear map of the
    flattened patch. The weight keeps the conv shape so checkpoints load unchanged."""

    def __init__(self, in_channels: int, temporal: int, patch: int, hidden: int,
                 dtype: torch.dtype) -> None:
        super().__init__()
        kernel = (temporal, patch, patch)
        self.proj = nn.Conv3d(in_channels, hidden, kernel_size=kernel, stride=kernel,
                              bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(x.reshape(-1, w[0].numel()), w.view(w.shape[0], -1))


class _VisionAttention(nn.Module):
    def __init__(self, hidden: int, num_heads: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden // num_heads
        self.qkv = nn.Linear(hidden, 3 * hidden, bias=True, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seg: _Segments) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return self.proj(_segment_attention(q, k, v, seg))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on [N, H, D] with fp32 [N, D] cos/sin (rotate-half layout)."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat((-x2, x1), dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)


def _segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       seg: _Segments) -> torch.Tensor:
    """Bidirectional attention within each segment: [N, H, D] x3 -> [N, H * D].

    One SDPA call per layout rather than a loop over segments: equal-length segments are a
    free view; ragged ones (edge windows, images of different sizes) are gathered into a
    padded batch with a key mask. A block-diagonal mask over the whole sequence would cost
    N^2 memory, and a per-segment loop hundreds of small launches per block."""
    n, heads, dim = q.shape
    if seg.pad_index is None:
        qs, ks, vs = (t.view(seg.count, seg.max_len, heads, dim).transpose(1, 2)
                      for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs)
        return out.transpose(1, 2).reshape(n, heads * dim)
    qs, ks, vs = (t[seg.pad_index].transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seg.key_mask)
    return out.transpose(1, 2).reshape(seg.count * seg.max_len, heads * dim)[seg.valid]


class _VisionMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str, dtype: torch.dtype) -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision hidden_act {act!r}")
        self.act = _ACTIVATIONS[act]
        self.gate_proj = nn.Linear(hidden, intermediate, bias=True, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=True, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=True, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _VisionBlock(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm1 = _RMSNorm(cfg.hidden_size, dtype)
        self.norm2 = _RMSNorm(cfg.hidden_size, dtype)
        self.attn = _VisionAttention(cfg.hidden_size, cfg.num_heads, dtype)
        self.mlp = _VisionMLP(cfg.hidden_size, cfg.intermediate_size,
                              getattr(cfg, "hidden_act", "silu"), dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                seg: _Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, seg)
        return x + self.mlp(self.norm2(x))


class _PatchMerger(nn.Module):
    """RMSNorm each patch, then an MLP over the merge x merge patches of one token."""

    def __init__(self, hidden: int, out_hidden: int, merge: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.merged = hidden * merge * merge
        self.ln_q = _RMSNorm(hidden, dtype)
        self.mlp = nn.Sequential(
            nn.Linear(self.merged, self.merged, dtype=dtype),
            nn.GELU(),
            nn.Linear(self.merged, out_hidden, dtype=dtype),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.merged))


class Qwen2_5_VisionTransformer(nn.Module):
    """pixel patches [N, C*T*P*P] + grid_thw -> merged image tokens [N / merge^2, out_hidden]."""

    def __init__(self, vision_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        cfg = vision_config
        self.merge = cfg.spatial_merge_size
        self.merge_unit = self.merge * self.merge
        # window side in merge units: window_size is in pixels
        self.window = cfg.window_size // self.merge // cfg.patch_size
        if self.window < 1:
            raise ValueError(f"window_size {cfg.window_size} is smaller than one merged patch")
        self.fullatt_block_indexes = frozenset(cfg.fullatt_block_indexes)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_heads
        rope = getattr(cfg, "rope_parameters", None) or {}
        theta = float(rope.get("rope_theta", 10000.0))
        # h and w each get head_dim // 4 frequencies; a plain attribute, not a buffer, so that
        # module.to(bfloat16) cannot round it
        half = head_dim // 2
        self._inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)
        in_channels = getattr(cfg, "in_channels", None) or getattr(cfg, "in_chans", 3)
        self.patch_embed = _PatchEmbed(in_channels, cfg.temporal_patch_size, cfg.patch_size,
                                       cfg.hidden_size, dtype)
        self.blocks = nn.ModuleList(_VisionBlock(cfg, dtype) for _ in range(cfg.depth))
        self.merger = _PatchMerger(cfg.hidden_size, cfg.out_hidden_size, self.merge, dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.forward_planned(pixel_values, self.plan(grid_thw))

    def forward_planned(self, pixel_values: torch.Tensor, plan: _Plan) -> torch.Tensor:
        """forward over a plan made before (a CUDA graph replays this part alone: the plan's
        host work and copies stay outside it)."""
        device = self.patch_embed.proj.weight.device
        if pixel_values.shape[0] != plan.positions.shape[0]:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches, grid_thw "
                             f"describes {plan.positions.shape[0]}")
        x = self.patch_embed(pixel_values.to(device=device, dtype=self.dtype))
        # the blocks run in window order: each window is then a contiguous run
        x = x.view(-1, self.merge_unit, x.shape[-1])[plan.window_index].flatten(0, 1)
        freqs = (plan.positions.float()[:, :, None] * plan.inv_freq).flatten(1)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        for i, block in enumerate(self.blocks):
            seg = plan.frames if i in self.fullatt_block_indexes else plan.windows
            x = block(x, cos, sin, seg)
        return self.merger(x)[plan.reverse]

    def plan(self, grid_thw: torch.Tensor) -> _Plan:
        """Everything that depends on the grids: grid_thw (best on the host: read with
        tolist) to Python, then index tensors to the tower's device."""
        device = self.patch_embed.proj.weight.device
        grid = [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]
        if not grid:
            raise ValueError("grid_thw holds no image")
        for t, h, w in grid:
            if t < 1 or h < 1 or w < 1 or h % self.merge or w % self.merge:
                raise ValueError(f"grid {(t, h, w)} is not a positive multiple of the "
                                 f"spatial merge size {self.merge}")
        order, window_units = _window_order(grid, self.merge, self.window)
        positions = _positions(grid, self.merge).view(-1, self.merge_unit, 2)[order]
        frames = [h * w for t, h, w in grid for _ in range(t)]
        return _Plan(
            window_index=order.to(device),
            reverse=torch.argsort(order).to(device),
            positions=positions.view(-1, 2).to(device),
            inv_freq=self._inv_freq.to(device),
            windows=_segments([n * self.merge_unit for n in window_units], device),
            frames=_segments(frames, device),
        )

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy tensors named relative to the tower (`blocks.0.norm1.weight`)."""
        return load_exact(self, weights, "Qwen2.5-VL")


def _positions(grid: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """(h, w) of every patch in input order: merge x merge blocks row-major, patches
    row-major inside a block, the same for every frame."""
    out = []
    for t, h, w in grid:
        hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        hw = torch.stack((hh, ww), dim=-1).view(h // merge, merge, w // merge, merge, 2)
        out.append(hw.permute(0, 2, 1, 3, 4).reshape(-1, 2).repeat(t, 1))
    return torch.cat(out)


def _window_order(grid: list[tuple[int, int, int]], merge: int,
                  window: int) -> tuple[torch.Tensor, list[int]]:
    """Merge units regrouped window by window (each frame tiled into window x window squares
    of merge units, the bottom and right ones cut short), and the units in each window."""
    order, sizes, offset = [], [], 0
    for t, h, w in grid:
        gh, gw = h // merge, w // merge
        nh, nw = -(-gh // window), -(-gw // window)
        padded = torch.full((t, nh * window, nw * window), -1, dtype=torch.long)
        padded[:, :gh, :gw] = torch.arange(offset, offset + t * gh * gw).view(t, gh, gw)
        tiles = padded.view(t, nh, window, nw, window).permute(0, 1, 3, 2, 4)
        tiles = tiles.reshape(-1, window * window)
        real = tiles >= 0
        order.append(tiles[real])
        sizes += real.sum(1).tolist()
        offset += t * gh * gw
    return torch.cat(order), sizes


def _segments(lengths: list[int], device: torch.device) -> _Segments:
    count, longest = len(lengths), max(lengths)
    if all(n == longest for n in lengths):
        return _Segments(count, longest)
    lens = torch.tensor(lengths)
    starts = lens.cumsum(0) - lens
    cols = torch.arange(longest)
    real = cols < lens[:, None]
    pad_index = torch.where(real, starts[:, None] + cols, 0)
    valid = real.flatten().nonzero().squeeze(1)
    return _Segments(count, longest, pad_index.to(device),
                     real.view(count, 1, 1, longest).to(device), valid.to(device))


@torch.no_grad()
def load_exact(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
               label: str) -> set[str]:
    """Copy tensors named relative to `module` into its same-named, same-shaped
    parameters; returns the names filled. Raises ValueError naming `label` otherwise."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        param = params.get(name)
        if param is None:
            raise ValueError(f"unknown {label} vision tensor {name!r}")
        if param.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                             f"expected {tuple(param.shape)}")
        param.copy_(tensor)
        loaded.add(name)
    return loaded
