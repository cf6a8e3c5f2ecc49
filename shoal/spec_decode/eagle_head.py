"""Builds method "eagle"'s draft head (shoal/models/llama_eagle.py's EagleLlamaHead) from its
checkpoint folder: the config checked against the target's, the tensors read (safetensors, or
the pytorch_model*.bin the published EAGLE-1 checkpoints come as, with
torch.load(weights_only=True): tensors only, no code) and renamed to the head's parameters."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shoal.loader.dummy import initialize_dummy_weights
from shoal.loader.safetensors_loader import load_folder_config
from shoal.models.llama import LlamaForCausalLM
from shoal.models.llama_eagle import EagleLlamaHead, renamed_eagle_tensors

logger = logging.getLogger(__name__)


def read_eagle_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an EAGLE folder: *.safetensors, else pytorch_model*.bin (how the
    published EAGLE-1 checkpoints come; read with torch.load(weights_only=True), which
    loads tensors only, no code)."""
    files = sorted(folder.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    if files:
        from safetensors import safe_open

        for file in files:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    out[name] = handle.get_tensor(name)
        return out
    files = sorted(folder.glob("pytorch_model*.bin"))
    if not files:
        raise ValueError(f"speculative_config: method 'eagle': {folder} has no *.safetensors "
                         "or pytorch_model*.bin weights")
    for file in files:
        state = torch.load(str(file), map_location="cpu", weights_only=True)
        out.update({k: v for k, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def _eagle_config(folder: Path, target_cfg: Any, max_model_len: int) -> Any:
    try:
        cfg = load_folder_config(folder)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config: method 'eagle': cannot read {folder}'s "
                         f"config.json ({e})") from e
    arch = " ".join(getattr(cfg, "architectures", None) or [])
    if "eagle3" in arch.lower():
        raise ValueError(f"speculative_config: {folder} is an EAGLE-3 head ({arch}); method "
                         "'eagle' runs EAGLE-1 heads; use method 'eagle3' for this one")
    for key in ("hidden_size", "vocab_size"):
        mine, theirs = getattr(cfg, key, None), getattr(target_cfg, key)
        if mine != theirs:
            raise ValueError(f"speculative_config: the EAGLE head {str(folder)!r} has "
                             f"{key}={mine}, the target {theirs}; they must be the same")
    if int(getattr(cfg, "num_hidden_layers", 0) or 0) < 1:
        raise ValueError(f"speculative_config: the EAGLE head {str(folder)!r} has no decoder "
                         "layer (num_hidden_layers < 1)")
    cfg = copy.deepcopy(cfg)
    if getattr(cfg, "max_position_embeddings", 0) < max_model_len:
        # The rotary table must reach the target's positions; llama3/yarn scaling keeps the
        # original length it was trained with.
        if getattr(cfg, "original_max_position_embeddings", None) is None:
            cfg.original_max_position_embeddings = cfg.max_position_embeddings
        cfg.max_position_embeddings = max_model_len
    return cfg


def build_eagle_head(config: Any, spec: Any, target: nn.Module, loaded: Any) -> EagleLlamaHead:
    """The EAGLE-1 head of spec.model for `target` (an EngineConfig, a SpeculativeConfig,
    the target model and its LoadedModel)."""
    if not isinstance(target, LlamaForCausalLM):
        raise ValueError("speculative_config: method 'eagle' drafts for Llama-family targets "
                         f"(LlamaForCausalLM and its kin), not {type(target).__name__}")
    folder = Path(spec.model).expanduser()
    if not folder.is_dir():
        raise ValueError(f"speculative_config: method 'eagle' needs a local folder with the "
                         f"EAGLE head's config.json and weights; {spec.model!r} is none "
                         "(shoal never downloads)")
    cfg = _eagle_config(folder, loaded.hf_config, config.scheduler_config.max_model_len)
    dummy = config.model_config.load_format == "dummy"
    tensors = {} if dummy else dict(renamed_eagle_tensors(read_eagle_tensors(folder).items()))
    if not dummy:
        if any(n.startswith("midlayer.") or n in ("d2t", "t2d") for n in tensors):
            raise ValueError(f"speculative_config: {folder} holds an EAGLE-3 head; method "
                             "'eagle' runs EAGLE-1 heads; use method 'eagle3' for this one")
        if "fc.weight" not in tensors:
            raise ValueError(f"speculative_config: {folder} is not an EAGLE-1 head (no "
                             "fc.weight tensor)")
    fc_bias = "fc.bias" in tensors
    qkv_bias = "layers.0.self_attn.q_proj.bias" in tensors
    dtype = config.model_config.dtype
    with torch.device(config.device):
        head = EagleLlamaHead(cfg, dtype, fc_bias=fc_bias, qkv_bias=qkv_bias,
                              use_triton_ops=config.use_triton_ops)
    if dummy:
        initialize_dummy_weights(head, seed=config.model_config.seed + 1)
        head.share_with(target, embed=True, head=True)
    else:
        head.load_weights(((n, t.to(torch.float32)) for n, t in tensors.items()), target)
    head.eval()
    logger.info("eagle: %d-layer head from %s (fc bias: %s)", cfg.num_hidden_layers, folder,
                fc_bias)
    return head
