"""An EAGLE-1 draft head for a Llama-family target (method "eagle"), run by
shoal/spec_decode/mtp.py's HiddenStateDrafter.

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

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from shoal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.layers.linear import ReplicatedLinear, default_weight_loader, load_tensor, packed_target
from shoal.models.llama import LlamaDecoderLayer, LlamaForCausalLM

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
            LlamaDecoderLayer(cfg, dtype, False, qkv_bias, use_triton_ops, layer=i)
            for i in range(cfg.num_hidden_layers))
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
        for name, tensor in renamed_eagle_tensors(weights):
            if name in ("embed_tokens.weight", "lm_head.weight"):
                own[name] = tensor
                continue
            dst, shard = packed_target(name, _PACKED)
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


def renamed_eagle_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Names as EagleLlamaHead's: a leading "model." dropped; the first layer's
    input_layernorm (which EAGLE does not apply) and rotary buffers skipped."""
    for name, tensor in weights:
        if name.startswith("model."):
            name = name[len("model."):]
        if "rotary_emb.inv_freq" in name or name == "layers.0.input_layernorm.weight":
            continue
        yield name, tensor
