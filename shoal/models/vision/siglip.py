"""The SigLIP vision transformer as Idefics3 (SmolVLM) uses it: a patch-embedding conv,
learned position embeddings, pre-LN encoder layers (bidirectional attention, GELU MLP) and a
final LayerNorm. Images of any size up to the trained one: a pixel mask says which patches
are real, and each image's real patch grid is spread over the trained grid of positions
(NaViT-style bucketing, as transformers' Idefics3VisionEmbeddings does).

Parameter names match transformers' `model.vision_model` except that q/k/v are one fused
`qkv_proj` (one matmul); load_weights takes the checkpoint's names under that prefix."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.layers.linear import default_weight_loader

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}


def patch_attention_mask(pixel_mask: torch.Tensor, patch: int) -> torch.Tensor:
    """[n, H, W] pixel mask (nonzero = a real pixel) -> [n, H/p, W/p] bool: a patch is real
    when any of its pixels is (pixels past the last whole patch are dropped, as the conv
    drops them)."""
    n, h, w = pixel_mask.shape
    gh, gw = h // patch, w // patch
    m = pixel_mask[:, :gh * patch, :gw * patch].reshape(n, gh, patch, gw, patch) != 0
    return m.any(dim=4).any(dim=2)


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_size = int(cfg.patch_size)
        self.side = int(cfg.image_size) // self.patch_size  # trained positions per side
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, self.patch_size,
                                         stride=self.patch_size, dtype=dtype)
        self.position_embedding = nn.Embedding(self.side ** 2, cfg.hidden_size, dtype=dtype)

    def position_ids(self, patch_mask: torch.Tensor) -> torch.Tensor:
        """[n, gh, gw] bool -> [n, gh * gw] positions. An image with rh x rw real patches has
        row i at fraction i / rh of its height, which picks the trained row that fraction
        falls in (likewise columns); padding patches take position 0. The float32 steps
        and boundaries are computed as transformers computes them, so that a fraction on
        a boundary falls in the same bucket."""
        n, gh, gw = patch_mask.shape
        dev = patch_mask.device
        bounds = torch.arange(1 / self.side, 1.0, 1 / self.side, device=dev)
        real_h = patch_mask[:, :, 0].sum(dim=1)  # rows of real patches, per image
        real_w = patch_mask[:, 0, :].sum(dim=1)
        frac_h = torch.arange(gh, device=dev, dtype=torch.float32)[None] * (1.0 / real_h)[:, None]
        frac_w = torch.arange(gw, device=dev, dtype=torch.float32)[None] * (1.0 / real_w)[:, None]
        row = torch.bucketize(frac_h.clamp(max=1.0 - 1e-6), bounds, right=True)
        col = torch.bucketize(frac_w.clamp(max=1.0 - 1e-6), bounds, right=True)
        ids = (row[:, :, None] * self.side + col[:, None, :]).reshape(n, -1)
        return torch.where(patch_mask.reshape(n, -1), ids, 0)

    def forward(self, pixel_values: torch.Tensor, patch_mask: torch.Tensor) -> torch.Tensor:
        """[n, C, H, W], [n, H/p, W/p] -> [n, (H/p) * (W/p), D], patches in row-major order."""
        x = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return x + self.position_embedding(self.position_ids(patch_mask))


class SiglipAttention(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = d // self.num_heads
        self.qkv_proj = nn.Linear(d, 3 * d, dtype=dtype)
        self.out_proj = nn.Linear(d, d, dtype=dtype)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """x [n, L, D]; key_mask [n, 1, 1, L] True on real patches, or None (all real)."""
        n, length, _ = x.shape
        qkv = self.qkv_proj(x).view(n, length, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [n, heads, L, head_dim]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        return self.out_proj(o.transpose(1, 2).reshape(n, length, -1))


class SiglipMLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if cfg.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported vision activation {cfg.hidden_act!r}")
        self.act = _ACTIVATIONS[cfg.hidden_act]
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class SiglipEncoderLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        eps = cfg.layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.self_attn = SiglipAttention(cfg, dtype)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=eps, dtype=dtype)
        self.mlp = SiglipMLP(cfg, dtype)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x), key_mask)
        return x + self.mlp(self.layer_norm2(x))


class SiglipEncoder(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(cfg, dtype)
                                    for _ in range(cfg.num_hidden_layers))


class SiglipVisionTransformer(nn.Module):
    """Images [n, C, H, W] (H, W multiples of the patch) -> patch features [n, L, D]."""

    def __init__(self, cfg: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.patch_size = int(cfg.patch_size)
        self.embeddings = SiglipVisionEmbeddings(cfg, dtype)
        self.encoder = SiglipEncoder(cfg, dtype)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, pixel_values: torch.Tensor,
                patch_mask: torch.Tensor | None = None) -> torch.Tensor:
        """patch_mask [n, H/p, W/p] bool (patch_attention_mask of the pixel mask); None:
        every patch is real."""
        n, _, h, w = pixel_values.shape
        if patch_mask is None:
            patch_mask = torch.ones(n, h // self.patch_size, w // self.patch_size,
                                    dtype=torch.bool, device=pixel_values.device)
        x = self.embeddings(pixel_values.to(self.post_layernorm.weight.dtype), patch_mask)
        # padding patches are masked out as keys only: as queries they run on, since the
        # connector folds every patch (as transformers' does). No mask when all are real,
        # which keeps SDPA on its fused kernels.
        key_mask = None if bool(patch_mask.all()) else patch_mask.reshape(n, 1, 1, -1)
        for layer in self.encoder.layers:
            x = layer(x, key_mask)
        return self.post_layernorm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors named as under transformers' vision_model (q/k/v into the
        fused qkv_proj); returns the names of the parameters filled."""
        return load_qkv_fused(self, weights, "the SigLIP vision tower")


def load_fused(param: torch.Tensor, tensor: torch.Tensor, shard: int | None) -> None:
    """Copies tensor into param, or into rows [shard * D, (shard + 1) * D) of a fused
    q/k/v parameter of 3 * D rows."""
    dst = param.data
    if shard is not None:
        rows = dst.shape[0] // 3
        dst = dst.narrow(0, shard * rows, rows)
    default_weight_loader(dst, tensor.to(param.dtype))


def load_qkv_fused(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                   where: str) -> set[str]:
    """Tensors named relative to `module` into its parameters, q/k/v into the fused
    qkv_proj; returns the names filled. Raises ValueError (naming `where`) for a tensor
    without a parameter."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        target, shard = name, None
        for src, index in _QKV.items():
            if f".{src}." in name:
                target, shard = name.replace(f".{src}.", ".qkv_proj."), index
                break
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                             f"{where}")
        load_fused(param, tensor, shard)
        loaded.add(target)
    return loaded
