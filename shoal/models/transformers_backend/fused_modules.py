"""transformers modules whose forward is a formula shoal has one fused kernel for, run
through that kernel: an RMSNorm of x * rsqrt(mean(x^2) + eps) * w is about eight elementwise
kernels in transformers (casts, pow, mean, add, rsqrt, two multiplies) and one in shoal; a
gated MLP down(silu(gate(x)) * up(x)) over a packed gate/up projection (packed_linear.py)
runs its SiLU and product as one kernel.

A module is swapped only when its forward gives the fused formula's result on probe inputs,
with probe weights, at construction (before the checkpoint is loaded: the weights are still
the builder's zeros, and are zeros again after the check): names are never trusted, so
Gemma's x * (1 + w) norm, a norm with another eps or that returns float32, or a GELU MLP
keeps transformers' own forward.

A norm must give shoal's result, through the path the engine will run (shoal's RMSNorm
forward on the model's device: the C++ kernel on the CPU, Triton on CUDA), in bfloat16 and in
each of the model's activation dtypes, with the same output dtype: in half precision at most
1% of the elements one ulp apart, which a different order of the sum of squares gives (a few
in ten thousand), and a formula that rounds elsewhere does not: OLMo 2's
(w * x_normed).to(dtype) rounds once where shoal (as Llama) rounds x_normed before the
multiply, one bf16 ulp apart in about a quarter of the elements. In float32 the two formulas
are one, and 1e-5 relative is asked."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shoal.layers.activation import SiluAndMul
from shoal.layers.norm import RMSNorm
from shoal.models.transformers_backend.packed_linear import (
    PackedMemberLinear,
    pack_shared_input_linears,
)

_PROBE_ROWS = 3
_NORM_PROBE_ROWS = 64


@dataclass(frozen=True)
class FusedModules:
    """What construction changed (module names), for tests and the start-up log."""

    packed: list[list[str]] = field(default_factory=list)  # linears sharing one GEMM
    norms: list[str] = field(default_factory=list)  # shoal's RMSNorm
    mlps: list[str] = field(default_factory=list)  # packed gate/up, fused SiLU * up


def fuse_modules(model: nn.Module, linear_inputs: dict[int, torch.Tensor]) -> FusedModules:
    """All of this module's swaps on a model just built (parameters still zeros);
    linear_inputs: what packed_linear.linear_inputs saw on a probe pass (their dtypes are
    the model's activation dtypes)."""
    packed = pack_shared_input_linears(model, linear_inputs)
    activations = [x.dtype for x in linear_inputs.values() if x.is_floating_point()]
    return FusedModules(packed, swap_rms_norms(model, activations), fuse_gated_mlps(model))


def _probe(shape: tuple[int, ...], like: torch.Tensor, seed: int,
           dtype: torch.dtype | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # (on the CPU: a default CUDA device would refuse the CPU generator)
    return torch.randn(shape, generator=g, device="cpu").to(dtype=dtype or like.dtype,
                                                            device=like.device)


def _close(a: Any, b: Any) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    tol = 1e-4 if a.dtype in (torch.float32, torch.float64) else 3e-2
    return torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def _same_norm(a: Any, b: Any) -> bool:
    """Same dtype and shape, and the values of one formula (the module docstring): in half
    precision at most 1% of the elements apart, each by at most one ulp; in float32 within
    1e-5 relative."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype and a.shape == b.shape):
        return False
    if a.dtype not in (torch.bfloat16, torch.float16):
        return torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6)
    af, bf = a.float(), b.float()
    diff = (af - bf).abs()
    info = torch.finfo(a.dtype)
    ulp = info.eps * torch.maximum(af.abs(), bf.abs()).clamp_min(info.tiny)
    return bool((diff <= ulp).all()) and (diff > 0).float().mean().item() <= 0.01


@torch.no_grad()
def _with_probe_weights(params: list[torch.Tensor], check: Callable[[], bool]) -> bool:
    """check() with the params filled with probe values (norm-like 1-D ones in [0.5, 1.5]),
    then zeros again (construction: nothing is loaded yet)."""
    for i, p in enumerate(params):
        if p.dim() == 1:
            p.copy_(_probe(p.shape, p, 100 + i).abs() * 0.5 + 0.5)
        else:
            p.copy_(_probe(p.shape, p, 100 + i) * p.shape[-1] ** -0.5)
    try:
        return check()
    finally:
        for p in params:
            p.zero_()


def _rms_norm_eps(module: nn.Module) -> float | None:
    """The eps of a module shaped like an RMSNorm (one 1-D weight, no children, no buffers),
    else None."""
    params = dict(module.named_parameters(recurse=False))
    if (list(params) != ["weight"] or params["weight"].dim() != 1 or any(module.children())
            or any(True for _ in module.buffers(recurse=False))):
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else None


def _same_as_rms_norm(module: nn.Module, fused: RMSNorm, dtypes: list[torch.dtype]) -> bool:
    """module(x) and fused(x) identical for x in each dtype: [1, rows, H] (the CPU kernel's
    shape), [1, 1, rows, H] (a per-head norm's: the torch path on the CPU) and x scaled
    near eps (mean(x^2) ~ eps tells one eps from another)."""
    w = module.weight

    def check() -> bool:
        for dtype in dtypes:
            # (enough rows that 1% means something at a tiny model's width)
            x = _probe((1, _NORM_PROBE_ROWS, w.shape[0]), w, 7, dtype)
            for t in (x, x.unsqueeze(1), x * fused.eps ** 0.5):
                if not _same_norm(module(t), fused(t)):
                    return False
        return True
    return _with_probe_weights([w], check)


def swap_rms_norms(model: nn.Module, activation_dtypes: Iterable[torch.dtype] = ()
                   ) -> list[str]:
    """Every module whose forward is RMSNorm(x) * w (_same_norm) becomes shoal's RMSNorm on
    the same weight parameter (its name unchanged). Probed in bfloat16 and each of
    activation_dtypes (the norm weight's dtype when none is given). Returns the swapped
    modules' names."""
    activations = list(activation_dtypes)
    swapped = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            eps = _rms_norm_eps(child)
            if eps is None or isinstance(child, RMSNorm):
                continue
            w = child.weight
            fused = RMSNorm(w.shape[0], eps, w.dtype)
            fused.weight = w
            fused.train(child.training)
            dtypes = list(dict.fromkeys([torch.bfloat16, *(activations or [w.dtype])]))
            if _same_as_rms_norm(child, fused, dtypes):
                setattr(parent, name, fused)
                swapped.append(f"{parent_name}.{name}".lstrip("."))
    return swapped


class _GatedSiluForward:
    """down(SiLU(gate) * up) from the packed gate/up output, in one fused kernel for the
    activation; the module's own forward where gate/up are no longer packed."""

    def __init__(self, module: nn.Module, act: SiluAndMul, own: Callable[..., Any]):
        self.gate: PackedMemberLinear = module.gate_proj
        self.up: PackedMemberLinear = module.up_proj
        self.down: nn.Module = module.down_proj
        self.act, self.own = act, own

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # (either member's parameter re-pointed: the packed tensor holds stale rows for it)
        if not (self.gate.still_packed() and self.up.still_packed()):
            return self.own(x)
        gate_up = self.gate.group.packed_output(x)
        h = self.act(gate_up.reshape(-1, gate_up.shape[-1]))
        return self.down(h.view(*gate_up.shape[:-1], h.shape[-1]))


def _gated_candidate(module: nn.Module) -> bool:
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    return (isinstance(gate, PackedMemberLinear) and isinstance(up, PackedMemberLinear)
            and gate.group is up.group and len(gate.group.sizes) == 2
            and (gate.index, up.index) == (0, 1) and gate.out_features == up.out_features
            and isinstance(getattr(module, "down_proj", None), nn.Linear)
            and isinstance(getattr(module, "act_fn", None), nn.Module)
            and "forward" not in module.__dict__)


def fuse_gated_mlps(model: nn.Module) -> list[str]:
    """Every module with packed gate_proj/up_proj, a down_proj and an act_fn whose forward is
    down(silu(gate(x)) * up(x)) runs _GatedSiluForward (checked once per class and
    activation class). Returns the modules' names."""
    verdict: dict[tuple[type, type], bool] = {}
    fused = []
    for name, module in model.named_modules():
        if not _gated_candidate(module):
            continue
        act = SiluAndMul()
        forward = _GatedSiluForward(module, act, module.forward)
        key = (type(module), type(module.act_fn))
        if key not in verdict:
            g = module.gate_proj.group
            params = [g.weight, module.down_proj.weight]
            params += [b for b in (g.bias, module.down_proj.bias) if b is not None]
            x = _probe((1, _PROBE_ROWS, g.weight.shape[1]), g.weight, 11)
            verdict[key] = _with_probe_weights(
                params, lambda m=module, f=forward, x=x: _close(m(x), f(x)))
        if verdict[key]:
            module.forward = forward
            fused.append(name)
    return fused
