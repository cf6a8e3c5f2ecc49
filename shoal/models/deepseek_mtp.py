"""DeepSeek-V3's multi-token-prediction (MTP) layer, run as a drafter (method "mtp").

Checkpoints store it after the main layers, as model.layers.{num_hidden_layers}.*: enorm and
hnorm (RMSNorms), eh_proj ([hidden, 2 * hidden]), a whole decoder layer (MLA attention with
its own latent KV cache, a MoE MLP), shared_head.norm, and, optionally, copies of the
embedding (embed_tokens) and of the output head (shared_head.head); without them it uses the
main model's.

For the token t at position p and the main model's (final-normed) hidden state h at p:

    x = eh_proj(cat([enorm(embed(next token)), hnorm(h)]))   # next token: the one at p + 1
    y = decoder_layer(x) at position p (with its residual added back)
    logits = head(shared_head.norm(y))                      # for the token at p + 2

y is also what a further draft step feeds back in place of h. As in vLLM, the embedding of a
row at position 0 is zeroed.

A checkpoint with num_nextn_predict_layers = n > 1 stores n such layers (depths), the j-th as
model.layers.{num_hidden_layers + j}.*, each with its own norms, eh_proj, decoder layer and
shared head. Depth j at position p reads depth j - 1's output y at p (depth 0: the main
model's h) and the token j positions further on than depth 0's (the one at p + j + 1), and
predicts the token at p + j + 2 (DeepSeek-V3's sequential MTP). DeepseekMTPDepths holds them;
shoal/spec_decode/mtp_chain.py runs them as a drafter."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from shoal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.layers.latent_attention import LatentAttention
from shoal.layers.linear import ReplicatedLinear, load_tensor
from shoal.layers.norm import RMSNorm
from shoal.models.deepseek_v2 import DeepseekDecoderLayer, deinterleave_rows, rope_is_interleaved
from shoal.models.deepseek_v32 import DeepseekV32DecoderLayer, is_sparse
from shoal.models.expert_weights import load_expert_tensors

# Tensors of the MTP layer itself (the rest belong to its decoder layer).
_OWN = ("embed_tokens.", "enorm.", "hnorm.", "eh_proj.", "shared_head.")
_PACKED = {"gate_proj": 0, "up_proj": 1}  # into the dense / shared-expert gate_up_proj


def num_mtp_layers(cfg: Any) -> int:
    return int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)


def mtp_prefix(cfg: Any, depth: int = 0) -> str:
    """The checkpoint prefix of the MTP layer of `depth` (0: the first)."""
    return f"model.layers.{cfg.num_hidden_layers + depth}."


class SharedHead(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops)
        self.head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, dtype)


class DeepseekMTP(nn.Module):
    """One MTP layer of a DeepSeek-V3-family config (depth 0: the first)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True,
                 depth: int = 0):
        super().__init__()
        self.config = cfg
        self.prefix = mtp_prefix(cfg, depth)
        h, eps, ops = cfg.hidden_size, cfg.rms_norm_eps, use_triton_ops
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h, dtype)
        self.enorm = RMSNorm(h, eps, dtype, ops)
        self.hnorm = RMSNorm(h, eps, dtype, ops)
        self.eh_proj = ReplicatedLinear(2 * h, h, bias=False, params_dtype=dtype)
        # V3.2's MTP layer has the indexer too
        layer_cls = DeepseekV32DecoderLayer if is_sparse(cfg) else DeepseekDecoderLayer
        self.mtp_block = layer_cls(cfg, dtype, cfg.num_hidden_layers + depth, ops)
        self.shared_head = SharedHead(cfg, dtype, ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                prev_hidden: torch.Tensor, md: Any) -> torch.Tensor:
        """input_ids: the token after each row's position; prev_hidden: the main model's
        hidden state at that position (or this layer's output, for later draft steps).
        Returns the layer's output before shared_head.norm."""
        emb = self.embed_tokens(input_ids)
        emb = torch.where((positions == 0).unsqueeze(-1), torch.zeros_like(emb), emb)
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(prev_hidden)], dim=-1))
        out, residual = self.mtp_block(positions, x, None, md)
        return out + residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head.compute_logits(self.shared_head.norm(hidden))

    def attention_layers(self) -> list[LatentAttention]:
        attn = self.mtp_block.self_attn
        return [attn.attn, attn.indexer] if hasattr(attn, "indexer") else [attn.attn]

    def share_with(self, target: nn.Module, embed: bool, head: bool) -> None:
        """Uses the main model's embedding and/or output head (no copy in the checkpoint)."""
        if embed:
            self.embed_tokens.weight = target.model.embed_tokens.weight
        if head:
            self.shared_head.head.weight = target.lm_head.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     target: nn.Module) -> set[str]:
        """Checkpoint tensors model.layers.{n}.* of this MTP layer (others are ignored);
        the embedding and the head fall back to the target's. Returns the names loaded;
        raises when a parameter of the layer was left unfilled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        rest = load_expert_tensors(self._renamed(weights), params, loaded, type(self).__name__)
        for name, tensor in rest:
            shard = None
            m = re.search(r"\.(gate_proj|up_proj)\.", name)
            if m and name.startswith("mtp_block.mlp."):
                shard = _PACKED[m[1]]
                name = name.replace(f".{m[1]}.", ".gate_up_proj.")
            param = params.get(name)
            if param is None:
                raise ValueError(f"MTP checkpoint tensor {name!r} has no matching parameter "
                                 f"in {type(self).__name__}")
            load_tensor(param, tensor, shard)
            loaded.add(name)
        share_embed = "embed_tokens.weight" not in loaded
        share_head = "shared_head.head.weight" not in loaded
        self.share_with(target, share_embed, share_head)
        loaded |= {"embed_tokens.weight", "shared_head.head.weight"}
        missing = sorted({n for n, _ in self.named_parameters()} - loaded)
        if missing:
            raise ValueError(f"the checkpoint's MTP layer lacks {missing[:5]}")
        return loaded

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """model.layers.{n}.X -> X for the layer's own tensors, mtp_block.X for its decoder
        layer's; interleaved rotary rows turned into halves, as the main model does."""
        cfg = self.config
        prefix = self.prefix
        interleaved = rope_is_interleaved(cfg)
        nope, rope, lora = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
        for name, tensor in weights:
            if not name.startswith(prefix) or "rotary_emb.inv_freq" in name:
                continue
            name = name[len(prefix):]
            if not name.startswith(_OWN):
                name = "mtp_block." + name
            if interleaved and re.search(r"\.self_attn\.(q_proj|q_b_proj)\.weight$", name):
                tensor = deinterleave_rows(tensor, nope, rope, nope + rope)
            elif interleaved and re.search(r"\.self_attn\.kv_a_proj_with_mqa\.(weight|bias)$",
                                           name):
                tensor = deinterleave_rows(tensor, lora, rope, tensor.shape[0])
            yield name, tensor


class DeepseekMTPDepths(nn.Module):
    """The first `depths` MTP layers of a checkpoint, run as a chain (depth j: the MTP layer
    model.layers.{num_hidden_layers + j}); each keeps its own KV cache."""

    def __init__(self, cfg: Any, dtype: torch.dtype, depths: int, use_triton_ops: bool = True):
        super().__init__()
        self.config = cfg
        self.num_depths = depths
        self.layers = nn.ModuleList([DeepseekMTP(cfg, dtype, use_triton_ops, depth=j)
                                     for j in range(depths)])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                prev_hidden: torch.Tensor, md: Any, depth: int = 0) -> torch.Tensor:
        return self.layers[depth](input_ids, positions, prev_hidden, md)

    def compute_logits(self, hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        return self.layers[depth].compute_logits(hidden)

    def attention_layers(self) -> list[LatentAttention]:
        return [a for layer in self.layers for a in layer.attention_layers()]

    def share_with(self, target: nn.Module, embed: bool, head: bool) -> None:
        for layer in self.layers:
            layer.share_with(target, embed, head)
