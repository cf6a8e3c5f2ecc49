"""Tiny linear-attention layers for the layer tests (Gated DeltaNet, Kimi Delta Attention):
the config both classes read, and random weights whose gates stay in range (A_log small,
dt_bias in [-4, -2], so the decays are neither 0 nor 1)."""

from __future__ import annotations

from types import SimpleNamespace

import torch


def tiny_linear_config(key_heads: int, value_heads: int, kda_heads: int,
                       hidden: int = 32) -> SimpleNamespace:
    """Heads of 16; kda_heads: Kimi's linear_num_heads."""
    return SimpleNamespace(hidden_size=hidden, rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
                           linear_num_key_heads=key_heads, linear_num_value_heads=value_heads,
                           linear_key_head_dim=16, linear_value_head_dim=16,
                           linear_num_heads=kda_heads, linear_head_dim=16)


def randomize_linear_layer(layer: torch.nn.Module, gen: torch.Generator, scale: float,
                           norm_near_one: bool = False) -> None:
    """Every parameter drawn from `gen` in named_parameters order: N(0, 0.3) for A_log,
    U(-4, -2) for dt_bias, U(0.5, 1.5) for the norm weights if norm_near_one, N(0, scale)
    for the rest."""
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            elif name.endswith("dt_bias"):
                p.copy_(torch.rand(p.shape, generator=gen) * 2 - 4)
            elif norm_near_one and name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
