"""An EAGLE-1 draft head for a Llama-family target (method "eagle"), run by
shoal/spec_decode/mtp.py's HiddenStateProposer.

For the token t at position p + 1 and the target's final (normed) hidden state h at p:

    x = fc(cat([embed(t), h]))          # fc: [hidden, 2 * hidden], a bias if stored
    y = decoder_layers(x) at position p  # Llama layers; the first has no input_layernorm
    logits = lm_head(y)                  # no final norm; predicts the token at p + 2

y (the last layer's output with its residual added back) is also what a further draft step
feeds back in place of h. The embedding and the head are the target's unless the checkpoint
stores its own (EAGLE's published checkpoints store a frozen copy of the target's embedding,
which is then shared rather than kept twice).

Checkpoint (as SafeAILab's EAGLE-1 checkpoints, e.g. yuhuili/EAGLE-LLaMA3.1-Instruct-8B):
a folder with a Llama config.json (architectures LlamaForCausalLM, num_hidden_layers 1, the
target's hidden_size and vocab_size) and pytorch_model.bin or *.safetensors holding
fc.weight (fc.bias), layers.0.self_attn.{q,k,v,o}_proj.weight, layers.0.mlp.{gate,up,
down}_proj.weight, layers.0.post_attention_layernorm.weight and optionally embed_tokens.weight
and lm_head.weight (a leading "model." is accepted too)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shoal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.layers.linear import ReplicatedLinear, default_weight_loader, load_tensor
from shoal.models.llama import LlamaDecoderLayer, LlamaForCausalLM

logger = logging.getLogger(__name__)

_PACKED = LlamaForCausalLM.packed_modules_mapping


class EagleLlamaHead(nn.Module):
    """EAGLE-1's draft head: fc over [embedding; target hidden state], then Llama decoder
    layers (the first without its input norm), then the output head."""

    def __init__(self, cfg: Any, dtype: torch.dtype, fc_bias: bool = False,
                 qkv_bias: bool = False, use_triton_ops: bool = True):
        super().__init__()
        self.config = cfg
        h = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h, dtype)
        self.fc = ReplicatedLinear(2 * h, h, bias=fc_bias, params_dtype=dtype)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, dtype, False, qkv_bias, use_triton_ops)
            for _ in range(cfg.num_hidden_layers))
        # EAGLE's first layer reads fc's output unnormed (its residual is that output too).
        self.layers[0].input_layernorm = nn.Identity()
        self.lm_head = ParallelLMHead(cfg.vocab_size, h, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                prev_hidden: torch.Tensor, md: Any) -> torch.Tensor:
        """input_ids: the token after each row's position; prev_hidden: the target's final
        hidden state at that position (or this head's output, for later draft steps).
        Returns the head's output state (before the output head)."""
        x = self.fc(torch.cat([self.embed_tokens(input_ids), prev_hidden], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, md)
        return x + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[Any]:
        return [layer.self_attn.attn for layer in self.layers]

    def share_with(self, target: nn.Module, embed: bool, head: bool) -> None:
        """Uses the target's embedding and/or output head."""
        if embed:
            self.embed_tokens.weight = target.model.embed_tokens.weight
        if head:
            self.lm_head.weight = target.lm_head.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     target: nn.Module) -> set[str]:
        """EAGLE checkpoint tensors; the embedding and the head fall back to the target's
        (and are shared when the checkpoint's copy equals the target's). Returns the names
        loaded; raises when a tensor has no parameter or a parameter was left unfilled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        own: dict[str, torch.Tensor] = {}
        for name, tensor in _renamed(weights):
            if name in ("embed_tokens.weight", "lm_head.weight"):
                own[name] = tensor
                continue
            dst, shard = name, None
            for src, (packed, shard_id) in _PACKED.items():
                if f".{src}." in name:
                    dst, shard = name.replace(f".{src}.", f".{packed}."), shard_id
                    break
            param = params.get(dst)
            if param is None:
                raise ValueError(f"EAGLE checkpoint tensor {name!r} has no matching parameter "
                                 f"in {type(self).__name__}")
            load_tensor(param, tensor, shard)
            loaded.add(dst)
        mine = {"embed_tokens.weight": target.model.embed_tokens.weight,
                "lm_head.weight": target.lm_head.weight}
        share = {}
        for name, theirs in mine.items():
            tensor = own.get(name)
            share[name] = tensor is None or (
                tensor.shape == theirs.shape
                and torch.equal(tensor.to(theirs.dtype), theirs.detach().cpu()))
            if not share[name]:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param,
                                                                       tensor.to(param.dtype))
        self.share_with(target, share["embed_tokens.weight"], share["lm_head.weight"])
        loaded |= set(mine)
        missing = sorted({n for n, _ in self.named_parameters()} - loaded)
        if missing:
            raise ValueError(f"the EAGLE checkpoint lacks {missing[:5]}")
        return loaded


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Names as EagleLlamaHead's: a leading "model." dropped; the first layer's
    input_layernorm (which EAGLE does not apply) and rotary buffers skipped."""
    for name, tensor in weights:
        if name.startswith("model."):
            name = name[len("model."):]
        if "rotary_emb.inv_freq" in name or name == "layers.0.input_layernorm.weight":
            continue
        yield name, tensor


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
    from shoal.loader.safetensors_loader import load_folder_config

    try:
        cfg = load_folder_config(folder)
    except (OSError, ValueError) as e:
        raise ValueError(f"speculative_config: method 'eagle': cannot read {folder}'s "
                         f"config.json ({e})") from e
    arch = " ".join(getattr(cfg, "architectures", None) or [])
    if "eagle3" in arch.lower():
        raise ValueError(f"speculative_config: {folder} is an EAGLE-3 head ({arch}); method "
                         "'eagle' runs EAGLE-1 heads (eagle3 is not supported yet)")
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
    tensors = {} if dummy else dict(_renamed(read_eagle_tensors(folder).items()))
    if not dummy:
        if any(n.startswith("midlayer.") or n in ("d2t", "t2d") for n in tensors):
            raise ValueError(f"speculative_config: {folder} holds an EAGLE-3 head; method "
                             "'eagle' runs EAGLE-1 heads (eagle3 is not supported yet)")
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
        from shoal.loader.dummy import initialize_dummy_weights

        initialize_dummy_weights(head, seed=config.model_config.seed + 1)
        head.share_with(target, embed=True, head=True)
    else:
        head.load_weights(((n, t.to(torch.float32)) for n, t in tensors.items()), target)
    head.eval()
    logger.info("eagle: %d-layer head from %s (fc bias: %s)", cfg.num_hidden_layers, folder,
                fc_bias)
    return head
