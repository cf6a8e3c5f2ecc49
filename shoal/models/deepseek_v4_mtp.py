"""DeepSeek-V4's multi-token-prediction (MTP) layers, run as a drafter (method "mtp").

DeepSeek's release stores the first as `mtp.0.*` (transformers 5.25 builds no MTP layer and
ignores those tensors): e_proj and h_proj ([hidden, hidden] each, where V3 has one eh_proj),
enorm, hnorm, a whole V4 decoder block (`attn.*`, `ffn.*`, `attn_norm`, `ffn_norm`, `hc_attn_*`,
`hc_ffn_*`, spelled as the main layers'), its own final collapse of the streams
(`hc_head_fn / base / scale`) and norm (`norm`); the embedding and the output head are the
main model's (a copy, `emb.tok_emb` / `embed` and `head`, loads when present).

The target's hidden state it reads is the main model's last hyper-connection streams S
[hc, D], before the final collapse and norm, as DeepSeek's reference inference (MTPBlock:
`x = e_proj(enorm(embed(ids))).unsqueeze(2) + h_proj(hnorm(x))` on [b, s, hc, d]) and
vLLM's V4 MTP read them. For the target's streams S at position p and the token t at p + 1:

    x = h_proj(hnorm(S)) + e_proj(enorm(embed(t)))   # per stream; the embedding's term on all
    y = block(x) at position p                       # a V4 decoder block: streams -> streams
    logits = head(norm(hc_head(y)))                  # for the token at p + 2

y (flattened [hc * D]) is also what a further draft step feeds back in place of S. With
num_nextn_predict_layers = n > 1 the checkpoint has n such layers, `mtp.{j}.*` (each its
own projections, norms, block and head collapse; DeepseekV4MTPDepths): layer j reads layer
j - 1's output streams y at p (layer 0: the target's S) and the token at p + j + 1, and
predicts the one at p + j + 2, the sequential chain DeepSeek-V3's MTP layers run
(shoal/spec_decode/mtp_chain.py drives it; each layer keeps its own window cache). Unlike
vLLM's V3 and V4 heads (and shoal's V3 one), the embedding at position 0 is not zeroed:
DeepSeek's reference does not.

The block is window-only (sliding_attention) with top-k routed experts: the released
compress_ratios give the MTP layer 0 (no compressor, no indexer tensors), and its layer id
(num_hidden_layers) is past the hash-routed ones. transformers' config keeps no entry for
it (layer_types stops at num_hidden_layers), so the kinds are fixed here, and a checkpoint
whose MTP layer has compressor or hash-routing tensors is refused: its compressed entries
would be several KV cache groups, which the drafter's cache (one group on the target's first
table, shoal/spec_decode/drafter_cache.py) does not hold. Its window rows follow the
target's first table, which a V4 target with CSA or HCA layers keeps whole.

Under tensor parallelism the block splits as the main layers do (heads, output groups,
experts); e_proj, h_proj and the hyper-connection head are small and replicated."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shoal.layers.compressed_attention import SLIDING
from shoal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.layers.hyper_connection import HyperHead
from shoal.layers.linear import ReplicatedLinear, load_tensor
from shoal.layers.norm import RMSNorm
from shoal.layers.paged_rows import PagedRows
from shoal.layers.request_spans import StepSpans
from shoal.models.deepseek_v4 import DeepseekV4DecoderLayer
from shoal.models.deepseek_v4_weights import mtp_name
from shoal.models.expert_weights import load_expert_tensors


def mtp_prefix(depth: int) -> str:
    """The release's prefix of MTP layer `depth`'s tensors."""
    return f"mtp.{depth}."


def mtp_block_config(cfg: Any) -> Any:
    """cfg with the MTP block's kinds at index num_hidden_layers: window-only attention, top-k
    routed experts (see the module's docstring)."""
    block = copy.copy(cfg)
    block.layer_types = [*cfg.layer_types, SLIDING]
    block.mlp_layer_types = [*cfg.mlp_layer_types, "moe"]
    return block


class DeepseekV4MTP(nn.Module):
    """One MTP layer of a DeepSeek-V4 checkpoint (depth 0: the first): a DraftHead
    (spec_decode/mtp.py) whose hidden states are flattened streams [n, hc * D]. Every depth's
    block takes the kinds fixed at index num_hidden_layers (mtp_block_config)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True,
                 depth: int = 0):
        super().__init__()
        self.config = cfg
        self.depth = depth
        self.prefix = mtp_prefix(depth)
        h, eps, ops = cfg.hidden_size, cfg.rms_norm_eps, use_triton_ops
        self.hc_mult, self.hidden = cfg.hc_mult, h
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, h, dtype)
        self.enorm = RMSNorm(h, eps, dtype, ops)
        self.hnorm = RMSNorm(h, eps, dtype, ops)
        self.e_proj = ReplicatedLinear(h, h, bias=False, params_dtype=dtype)
        self.h_proj = ReplicatedLinear(h, h, bias=False, params_dtype=dtype)
        self.mtp_block = DeepseekV4DecoderLayer(mtp_block_config(cfg), cfg.num_hidden_layers,
                                                dtype, ops)
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(h, eps, dtype, ops)
        self.lm_head = ParallelLMHead(cfg.vocab_size, h, dtype)

    @property
    def state_size(self) -> int:
        """The width of the hidden state it reads and returns: the flattened streams."""
        return self.hc_mult * self.hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                prev_hidden: torch.Tensor, md: Any) -> torch.Tensor:
        """input_ids: the token after each row's position; prev_hidden [n, hc * D]: the
        target's streams there (or this layer's output, for later draft steps). Returns the
        block's output streams, flattened."""
        n, hc, d = input_ids.shape[0], self.hc_mult, self.hidden
        e = self.e_proj(self.enorm(self.embed_tokens(input_ids)))
        s = self.h_proj(self.hnorm(prev_hidden.reshape(n * hc, d))).view(n, hc, d)
        streams = s + e.unsqueeze(1)
        out = self.mtp_block(streams, input_ids, positions, StepSpans.of(md, positions))
        return out.flatten(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        streams = hidden.view(hidden.shape[0], self.hc_mult, self.hidden)
        return self.lm_head.compute_logits(self.norm(self.hc_head(streams)))

    def attention_layers(self) -> list[PagedRows]:
        return self.mtp_block.self_attn.paged_layers()  # the window's rows only

    def share_with(self, target: nn.Module, embed: bool, head: bool) -> None:
        """Uses the main model's embedding and/or output head (no copy in the checkpoint)."""
        if embed:
            self.embed_tokens.weight = target.model.embed_tokens.weight
        if head:
            self.lm_head.weight = target.lm_head.weight

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     target: nn.Module) -> set[str]:
        """The release's mtp.{depth}.* tensors (others are ignored); the embedding and the
        head fall back to the target's. Raises on a tensor it has no parameter for (a
        compressed or hash-routed MTP layer among them) and on a parameter left unfilled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        renamed = ((mtp_name(n, self.depth), t) for n, t in weights
                   if mtp_name(n, self.depth) is not None)
        for name, tensor in load_expert_tensors(renamed, params, loaded, type(self).__name__):
            param = params.get(name)
            if param is None:
                raise ValueError(_unknown(name))
            load_tensor(param, tensor)
            loaded.add(name)
        self.share_with(target, "embed_tokens.weight" not in loaded,
                        "lm_head.weight" not in loaded)
        loaded |= {"embed_tokens.weight", "lm_head.weight"}
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint's MTP layer ({self.prefix}*) lacks {missing[:5]}")
        return loaded


class DeepseekV4MTPDepths(nn.Module):
    """The first `depths` MTP layers of a DeepSeek-V4 checkpoint, run as a chain (depth j:
    `mtp.{j}.*`), each with its own window cache (HiddenStateDrafter with num_depths > 1)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, depths: int, use_triton_ops: bool = True):
        super().__init__()
        if depths < 2:
            raise ValueError(f"DeepseekV4MTPDepths chains 2 or more MTP layers (got {depths}); "
                             "one is a DeepseekV4MTP")
        self.config = cfg
        self.num_depths = depths
        self.layers = nn.ModuleList([DeepseekV4MTP(cfg, dtype, use_triton_ops, depth=j)
                                     for j in range(depths)])

    @property
    def state_size(self) -> int:
        return self.layers[0].state_size

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                prev_hidden: torch.Tensor, md: Any, depth: int = 0) -> torch.Tensor:
        return self.layers[depth](input_ids, positions, prev_hidden, md)

    def compute_logits(self, hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        return self.layers[depth].compute_logits(hidden)

    def attention_layers(self) -> list[PagedRows]:
        return [a for layer in self.layers for a in layer.attention_layers()]

    def share_with(self, target: nn.Module, embed: bool, head: bool) -> None:
        for layer in self.layers:
            layer.share_with(target, embed, head)


def _unknown(name: str) -> str:
    if ".compressor." in name or ".indexer." in name:
        why = ("its attention is compressed (CSA / HCA), whose several KV cache groups the "
               "drafter's cache does not hold: shoal's V4 MTP block is window-only")
    elif name.endswith("tid2eid"):
        why = "its experts are hash-routed: shoal's V4 MTP block routes them top-k"
    else:
        why = "no matching parameter in DeepseekV4MTP"
    return f"MTP checkpoint tensor {name!r} cannot load: {why}"
