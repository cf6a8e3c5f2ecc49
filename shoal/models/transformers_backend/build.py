"""Building a transformers model (a causal LM, an encoder) without initializing its weights:
parameters are created on the meta device and then materialized (zeros, in the engine's
dtype, on its device); the checkpoint fills them afterwards. Buffers are left real: they
hold values computed at construction (rotary frequencies, embedding scales) that checkpoints
do not store."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from shoal.models.transformers_backend.attention import (
    ATTN_IMPLEMENTATION,
    register_attention_function,
)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter registered inside lands on the meta device (no memory, no init cost);
    buffers are untouched."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def build_causal_lm(hf_config: Any, dtype: torch.dtype, device: torch.device,
                    prune: Callable[[nn.Module], nn.Module | None] | None = None
                    ) -> nn.Module:
    """transformers' causal LM for the config with shoal's attention function, parameters
    zero-filled in `dtype` on `device` (tied ones stay one tensor), in eval mode. `prune`
    sees the model while its parameters are still on the meta device: what it removes
    (another pipeline stage's layers, a pooling model's LM head) never takes memory."""
    from transformers import AutoModelForCausalLM

    return build_model(AutoModelForCausalLM.from_config, hf_config, dtype, device, prune)


def build_model(make: Callable[..., nn.Module], hf_config: Any, dtype: torch.dtype,
                device: torch.device,
                prune: Callable[[nn.Module], nn.Module | None] | None = None,
                attn_implementation: str | None = ATTN_IMPLEMENTATION) -> nn.Module:
    """`make(config, dtype=..., attn_implementation=...)` (an Auto class's from_config, or a
    model class's _from_config) built as build_causal_lm says. `prune` may return a
    submodule to keep instead of the whole model (an encoder's base model without its
    checkpoint's heads): only that is materialized and returned. attn_implementation None
    leaves the attention to transformers' default for the class (an encoder whose modeling
    code takes no custom attention function: encoder_padded.py)."""
    register_attention_function()
    cfg = copy.deepcopy(hf_config)  # from_config writes dtype and the attention choice into it
    with torch.device(device), parameters_on_meta():
        model = make(cfg, dtype=dtype, attn_implementation=attn_implementation)
    if prune is not None:
        model = prune(model) or model
    materialize(model, device)
    return model.eval().requires_grad_(False)


@torch.no_grad()
def materialize(model: nn.Module, device: torch.device) -> None:
    """Meta parameters -> zeros on `device` in their own dtype (one new tensor per meta
    tensor, so tied weights stay tied); buffers moved to `device`."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            new = made.get(id(param))
            if new is None:
                new = nn.Parameter(torch.zeros(param.shape, dtype=param.dtype, device=device),
                                   requires_grad=False)
                made[id(param)] = new
            module._parameters[name] = new
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                if buf.device.type == "meta":
                    raise ValueError(f"{type(module).__name__}.{name}: a buffer built from "
                                     "parameters at construction (not supported)")
                module._buffers[name] = buf.to(device)


def adopt(wrapper: nn.Module, hf: nn.Module) -> None:
    """hf's children and own parameters become wrapper's, so parameter names are the
    checkpoint's; hf itself is kept unregistered (wrapper.hf_model)."""
    wrapper.__dict__["hf_model"] = hf
    for name, child in hf.named_children():
        wrapper.add_module(name, child)
    for name, param in hf._parameters.items():
        if param is not None:
            wrapper.register_parameter(name, param)
