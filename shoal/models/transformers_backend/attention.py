"""shoal's paged attention behind transformers' attention interface.

transformers' modeling code calls `ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`
from every attention module with query [B, H, S, D] and key/value [B, Hk, S, D]; registering
ATTN_IMPLEMENTATION there routes those calls here. The function itself is global, so what
a call needs (the step's metadata, which paged layer the calling module writes) travels in a
context variable that TransformersForCausalLM.forward sets around its pass; an encoder's
pooling forward (encoder.py) sets a PackedStep instead, whose calls attend bidirectionally
within each packed prompt (encoder_attention.py). Nothing else sets it, so a stray call
outside a shoal forward fails loudly.

A probe pass (`probe_attention`) runs the model once at construction and records what each
attention module passes (heads, head size, scaling, window, soft-cap, masks): the paged
layers are built from what the model really does, not from config field names, which
differ from one architecture to the next. A module's soft-cap (Gemma 2's `softcap`) is kept
by its paged layer, which hands it to the backend the runner binds and refuses one without
supports_softcap."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shoal.layers.attention import Attention
from shoal.models.transformers_backend.encoder_attention import (
    PackedStep,
    packed_bidirectional,
)

ATTN_IMPLEMENTATION = "shoal_paged"


@dataclass(frozen=True)
class AttentionCall:
    """What one attention module passed to the attention function (seen by the probe)."""

    module: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    value_dim: int
    scaling: float | None
    sliding_window: int | None
    softcap: float | None
    is_causal: bool
    own_mask: bool  # the module built an attention mask itself (transformers builds none)


@dataclass
class _Probe:
    calls: list[AttentionCall] = field(default_factory=list)


@dataclass(frozen=True)
class _Step:
    metadata: Any
    layers: dict[int, Attention]  # id(attention module) -> its paged layer


_CURRENT: ContextVar[_Probe | _Step | PackedStep | None] = ContextVar(
    "shoal_transformers_step", default=None)


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: torch.Tensor | None,
                    scaling: float | None = None, dropout: float = 0.0,
                    sliding_window: int | None = None, softcap: float | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls. The batch is shoal's flattened step
    ([1, T]: every request's tokens back to back), so `attention_mask` is None (mask creation
    is skipped for implementations it does not know) and causality per request comes from
    the metadata. Returns [1, T, H, D], as transformers' own functions do."""
    current = _CURRENT.get()
    if isinstance(current, _Probe):
        current.calls.append(_record(module, query, key, value, attention_mask, scaling,
                                     sliding_window, softcap, kwargs))
        b, h, s, d = query.shape
        return query.new_zeros(b, s, h, d), None
    if isinstance(current, PackedStep):  # an encoder's pooling step: no paged layers
        if softcap or kwargs.get("s_aux") is not None:
            raise NotImplementedError(f"{type(module).__name__}: attention soft-capping or "
                                      "sinks in an encoder's packed attention")
        return packed_bidirectional(query, key, value, current.seqs, scaling,
                                    sliding_window), None
    if current is None:
        raise RuntimeError(f"{ATTN_IMPLEMENTATION} attention called outside a shoal forward "
                           "pass")
    if query.shape[0] != 1:
        raise ValueError(f"shoal runs a step as one flattened sequence (got batch "
                         f"{query.shape[0]})")
    layer = current.layers[id(module)]
    if (softcap or None) != layer.softcap:
        # The layer applies the cap the probe saw; a module whose cap changed since would
        # be run with the wrong one.
        raise RuntimeError(f"{type(module).__name__} passed attention soft-cap {softcap}, "
                           f"its paged layer was built with {layer.softcap}")
    # [1, H, T, D] -> [T, H, D]: the layout of shoal's paged layers; keys and values in the
    # query's dtype (some models compute them in float32 under a lower model dtype).
    # s_aux: attention sinks (gpt-oss), which the layer checks the backend has.
    q = _token_major(query, query.dtype)
    k = _token_major(key, q.dtype)
    v = _token_major(value, q.dtype)
    out = layer(q, k, v, current.metadata, sinks=kwargs.get("s_aux"))
    return out.unsqueeze(0), None


def _token_major(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[1, H, T, D] -> [T, H, D] in dtype, copied only where its heads are not rows of D
    packed values (a column slice of a packed q/k/v projection is read in place, as native
    layers read their split qkv)."""
    x = x[0].transpose(0, 1).to(dtype)
    if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1]:
        return x
    return x.contiguous()


def in_shoal_forward() -> bool:
    """Whether a shoal step (or the construction probe) is running the model now."""
    return _CURRENT.get() is not None


def _record(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            attention_mask: torch.Tensor | None, scaling: float | None,
            sliding_window: int | None, softcap: float | None,
            kwargs: dict[str, Any]) -> AttentionCall:
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    return AttentionCall(module, query.shape[1], key.shape[1], key.shape[-1],
                         value.shape[-1], scaling, sliding_window or None, softcap,
                         bool(causal), attention_mask is not None)


@contextmanager
def step_context(metadata: Any, layers: dict[int, Attention]) -> Iterator[None]:
    """The step every attention call inside reads (set by the model's forward)."""
    token = _CURRENT.set(_Step(metadata, layers))
    try:
        yield
    finally:
        _CURRENT.reset(token)


@contextmanager
def packed_step_context(step: PackedStep) -> Iterator[None]:
    """The pooling step an encoder's attention calls read (set by encoder.py's forward)."""
    token = _CURRENT.set(step)
    try:
        yield
    finally:
        _CURRENT.reset(token)


def probe_attention(run: Callable[[], Any]) -> list[AttentionCall]:
    """The attention calls of one pass of `run` (attention itself returns zeros)."""
    probe = _Probe()
    token = _CURRENT.set(probe)
    try:
        run()
    finally:
        _CURRENT.reset(token)
    return probe.calls


def register_attention_function() -> None:
    """Makes ATTN_IMPLEMENTATION a valid `attn_implementation` (idempotent). A name the
    mask interface does not know makes transformers skip building causal masks, which the
    flattened batch must not get."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)
