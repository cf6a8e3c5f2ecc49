"""transformers' rotate-half rotary in fewer kernels inside shoal's steps.

Modeling code applies rotary with its module's `apply_rotary_pos_emb(q, k, cos, sin)`:
q * cos + rotate_half(q) * sin, where rotate_half slices, negates and concatenates: five
elementwise kernels per tensor, ten per layer. rotate_half(x) * sin equals
roll(x, D/2) * (sin with its first half negated), and that signed sine is the same for
every layer of a step, so each tensor takes three kernels (multiply, roll, multiply-add)
and the step one more.

The function is replaced in its modeling module's namespace (what the attention modules
call) by a wrapper that takes the short path only inside a shoal forward pass (the
attention context is set) and for calls of the standard form; everywhere else (transformers
used directly in the same process, other forms) it calls the original. It is replaced only
where the original gives the short path's result on probe tensors, within rounding: the
multiply-add rounds once where rotate-half rounds after each op, so in bf16 about a fifth of
the elements sit one ulp from transformers' (unlike the norms, which fused_modules.py holds
to shoal's own kernel: rotary has no formula variant that a tolerance would let through
unnoticed, only where it rounds)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shoal.models.transformers_backend.attention import in_shoal_forward

_NAME = "apply_rotary_pos_emb"


class _SignedSine:
    """sin with its first half negated, for the step whose sin tensor it was made from (the
    one tensor every layer of a step is handed)."""

    def __init__(self) -> None:
        self.sin: torch.Tensor | None = None
        self.signed: torch.Tensor | None = None

    def of(self, sin: torch.Tensor) -> torch.Tensor:
        if sin is not self.sin:
            half = sin.shape[-1] // 2
            self.signed = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
            self.sin = sin
        assert self.signed is not None
        return self.signed


def rotate_half_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                     sin_signed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, H, T, D]; cos, sin_signed [B, T, D]."""
    cos, sin_signed = cos.unsqueeze(1), sin_signed.unsqueeze(1)
    half = q.shape[-1] // 2

    def one(x: torch.Tensor) -> torch.Tensor:
        return torch.addcmul(x * cos, x.roll(half, dims=-1), sin_signed)
    return one(q), one(k)


class ShortRope:
    """The wrapper installed in place of a modeling module's apply_rotary_pos_emb."""

    def __init__(self, original: Callable[..., Any]):
        self.original = original
        self.signed = _SignedSine()

    def __call__(self, q: Any, k: Any, cos: Any, sin: Any, *args: Any, **kwargs: Any) -> Any:
        if (args or kwargs) and not _default_unsqueeze(args, kwargs):
            return self.original(q, k, cos, sin, *args, **kwargs)
        if not (in_shoal_forward() and _standard(q, k, cos, sin)):
            return self.original(q, k, cos, sin, *args, **kwargs)
        return rotate_half_rope(q, k, cos, self.signed.of(sin))


def _default_unsqueeze(args: tuple, kwargs: dict) -> bool:
    """Whether the extra arguments are unsqueeze_dim=1 and nothing else. An int 1 only: a
    tensor there (position_ids passed positionally) == 1 is a tensor, not a bool."""
    if args:
        return len(args) == 1 and not kwargs and _is_one(args[0])
    return list(kwargs) == ["unsqueeze_dim"] and _is_one(kwargs["unsqueeze_dim"])


def _is_one(value: Any) -> bool:
    return type(value) is int and value == 1


def _standard(q: Any, k: Any, cos: Any, sin: Any) -> bool:
    if not all(isinstance(t, torch.Tensor) for t in (q, k, cos, sin)):
        return False
    d = q.shape[-1]
    return (q.dim() == k.dim() == 4 and cos.dim() == sin.dim() == 3 and d % 2 == 0
            and k.shape[-1] == d and cos.shape == sin.shape and cos.shape[-1] == d
            and cos.shape[1] == q.shape[2] == k.shape[2] and cos.dtype == q.dtype == k.dtype)


@torch.no_grad()
def _same_as_rotate_half(fn: Callable[..., Any], like: torch.Tensor) -> bool:
    g = torch.Generator().manual_seed(5)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, device="cpu").to(dtype=like.dtype, device=like.device)
    q, k, cos, sin = rnd(1, 4, 3, 16), rnd(1, 2, 3, 16), rnd(1, 3, 16), rnd(1, 3, 16)
    try:
        want = fn(q, k, cos, sin)
    except Exception:  # (a function of another form)
        return False
    got = rotate_half_rope(q, k, cos, _SignedSine().of(sin))
    tol = 1e-4 if like.dtype == torch.float32 else 3e-2
    return (isinstance(want, tuple) and len(want) == 2
            and all(isinstance(w, torch.Tensor) and w.shape == o.shape and w.dtype == o.dtype
                    and torch.allclose(w.float(), o.float(), rtol=tol, atol=tol)
                    for w, o in zip(want, got)))


def shorten_rotary(attention_modules: list[nn.Module], like: torch.Tensor) -> list[str]:
    """Installs ShortRope in the modeling module of each attention module's class whose
    apply_rotary_pos_emb is rotate-half rotary (idempotent). Returns those modules' names."""
    done = []
    for module_name in dict.fromkeys(type(m).__module__ for m in attention_modules):
        namespace = sys.modules.get(module_name)
        fn = getattr(namespace, _NAME, None)
        if isinstance(fn, ShortRope):
            done.append(module_name)
        elif callable(fn) and _same_as_rotate_half(fn, like):
            setattr(namespace, _NAME, ShortRope(fn))
            done.append(module_name)
    return done
