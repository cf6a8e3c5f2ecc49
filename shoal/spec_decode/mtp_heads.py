"""The heads of method "mtp": a target's multi-token-prediction layers (DeepSeek-V3's and
Kimi-K2's, shoal/models/deepseek_mtp.py; Qwen3-Next's and Qwen3.5's, qwen3_next_mtp.py;
DeepSeek-V4's, deepseek_v4_mtp.py), built beside the target and loaded from its checkpoint
(only the MTP tensors are read), or given dummy weights. HiddenStateDrafter (mtp.py) drafts
with them; DraftHead is what it asks of a head."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from shoal.config import EngineConfig
from shoal.loader.dummy import initialize_dummy_weights
from shoal.models.deepseek_mtp import DeepseekMTP, DeepseekMTPDepths, mtp_prefix
from shoal.models.qwen3_next import Qwen3NextForCausalLM
from shoal.models.qwen3_next_mtp import PREFIX as QWEN_MTP_PREFIX
from shoal.models.qwen3_next_mtp import Qwen3NextMTP
from shoal.spec_decode.mtp_target import check_mtp_target, is_v4, mtp_layer_count

logger = logging.getLogger(__name__)


def read_mtp_tensors(source: str, hf_config: Any,
                     prefix: str | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """One MTP layer's tensors of a safetensors folder (only those are read), one at a time
    in the checkpoint's dtype (dequantized, when the checkpoint is quantized: see
    shoal/quantization): DeepSeek-V3's layer holds 256 experts. prefix: the layer's
    (DeepSeek's first, model.layers.{n}., by default)."""
    from safetensors import safe_open

    from shoal.loader.safetensors_loader import safetensors_files
    from shoal.quantization.config import detect_quantization
    from shoal.quantization.weights import dequantized_weights

    prefix = prefix or mtp_prefix(hf_config)
    found = 0

    def stored() -> Iterator[tuple[str, torch.Tensor]]:
        nonlocal found
        for file in safetensors_files(Path(source)):
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    if name.startswith(prefix):
                        found += 1
                        yield name, handle.get_tensor(name)

    qconfig = detect_quantization(hf_config, Path(source))  # a quantized checkpoint's layer
    yield from (stored() if qconfig is None else dequantized_weights(stored, qconfig)())
    if not found:
        raise ValueError(
            f"speculative_config: method 'mtp': {source} has no multi-token-prediction "
            f"tensors ({prefix}*), although its config has {mtp_layer_count(hf_config)} "
            "MTP layers")


class DraftHead(Protocol):
    """What HiddenStateDrafter drafts with (see the module's docstring)."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 prev_hidden: torch.Tensor, md: Any) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def attention_layers(self) -> list[Any]: ...


def build_mtp_head(config: EngineConfig, target: nn.Module, loaded: Any) -> nn.Module:
    """The target's MTP layers (method "mtp"), loaded from the target's checkpoint: the
    first min(layers, num_speculative_tokens) of them (mtp_chain.py)."""
    hf = loaded.hf_config
    spec = config.speculative_config
    k = spec.num_speculative_tokens if spec is not None else 1
    depths = max(1, min(mtp_layer_count(hf), k))
    if mtp_layer_count(hf) > 1:
        logger.info("mtp: the checkpoint has %d MTP layers; drafts 1..%d use the first %d "
                    "in a chain%s", mtp_layer_count(hf), depths, depths,
                    f", the later {k - depths} the last one alone" if k > depths else "")
    if is_v4(hf):
        return _v4_mtp_head(config, target, loaded, depths)
    if isinstance(target, Qwen3NextForCausalLM):  # (Qwen3.5's classes too)
        return _qwen_mtp_head(config, target, loaded, depths)
    check_mtp_target(hf)
    dtype = config.model_config.dtype
    with torch.device(config.device):
        head: nn.Module = (DeepseekMTP(hf, dtype, use_triton_ops=config.use_triton_ops)
                           if depths == 1 else
                           DeepseekMTPDepths(hf, dtype, depths, config.use_triton_ops))
    if config.model_config.load_format == "dummy":
        initialize_dummy_weights(head, seed=config.model_config.seed + 1)
        head.share_with(target, embed=True, head=True)
    else:
        if loaded.load_format != "safetensors":
            raise ValueError("speculative_config: method 'mtp' loads its layer from a "
                             f"safetensors folder, not {loaded.load_format}")
        for j, layer in enumerate([head] if depths == 1 else head.layers):
            layer.load_weights(read_mtp_tensors(loaded.source, hf, mtp_prefix(hf, j)), target)
    return head.eval()


def _qwen_mtp_head(config: EngineConfig, target: nn.Module, loaded: Any,
                   depths: int) -> nn.Module:
    """Qwen3-Next's / Qwen3.5's MTP layers (mtp.*), on the target's embedding and head."""
    hf = loaded.hf_config
    check_mtp_target(hf, qwen=True)
    with torch.device(config.device):
        head = Qwen3NextMTP(hf, config.model_config.dtype, target,
                            use_triton_ops=config.use_triton_ops, depths=depths)
    if config.model_config.load_format == "dummy":
        initialize_dummy_weights(head, seed=config.model_config.seed + 1)
    elif loaded.load_format != "safetensors":
        raise ValueError("speculative_config: method 'mtp' loads its layer from a "
                         f"safetensors folder, not {loaded.load_format}")
    else:
        head.load_weights(read_mtp_tensors(loaded.source, hf, QWEN_MTP_PREFIX))
    return head.eval()


def _v4_mtp_head(config: EngineConfig, target: nn.Module, loaded: Any,
                 depths: int) -> nn.Module:
    """DeepSeek-V4's first `depths` MTP layers (mtp.{j}.*), chained as V3's are; the target
    hands them its hyper-connection streams from now on."""
    from shoal.models.deepseek_v4_mtp import DeepseekV4MTP, DeepseekV4MTPDepths, mtp_prefix

    hf = loaded.hf_config
    check_mtp_target(hf)
    dtype, ops = config.model_config.dtype, config.use_triton_ops
    with torch.device(config.device):
        head: nn.Module = (DeepseekV4MTP(hf, dtype, ops) if depths == 1 else
                           DeepseekV4MTPDepths(hf, dtype, depths, ops))
    if config.model_config.load_format == "dummy":
        initialize_dummy_weights(head, seed=config.model_config.seed + 1)
        head.share_with(target, embed=True, head=True)
    elif loaded.load_format != "safetensors":
        raise ValueError("speculative_config: method 'mtp' loads its layer from a "
                         f"safetensors folder, not {loaded.load_format}")
    else:
        for j, layer in enumerate([head] if depths == 1 else head.layers):
            layer.load_weights(read_mtp_tensors(loaded.source, hf, mtp_prefix(j)), target)
    target.output_streams()
    return head.eval()
