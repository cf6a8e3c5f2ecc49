"""The multi-token-prediction (MTP) layer of Qwen3-Next and Qwen3.5 checkpoints, run as a
drafter (method "mtp", shoal/spec_decode/mtp.py).

Checkpoints store it beside the main model as mtp.*: pre_fc_norm_embedding and
pre_fc_norm_hidden (offset RMSNorms), fc ([hidden, 2 * hidden]), layers.0 (a full-attention
decoder layer with the main layers' MLP kind: a shared-expert MoE for Qwen3-Next and
Qwen3.5-MoE, dense for Qwen3.5) and norm; the embedding and the output head are the main
model's. For the token t at position p and the main model's (final-normed) hidden state h at
p:

    x = fc(cat([pre_fc_norm_embedding(embed(next token)), pre_fc_norm_hidden(h)]))
    y = norm(layers.0(x) at position p, its residual added)   # fed back for draft 2..k
    logits = lm_head(y)                                       # for the token at p + 2

Its attention layer keeps a KV cache of its own on the target's full-attention block table
(a linear-attention state would have to follow the target's replays: the layer has none).

With mtp_num_hidden_layers = n > 1 the checkpoint stores layers.0 .. layers.{n-1}, one per
depth, beside ONE fc, pair of input norms and output norm that every depth shares (as vLLM
reads these checkpoints): depth j runs the formula above with layers.j, on depth j - 1's y in
place of h and the token j positions further on (shoal/spec_decode/mtp_chain.py). `depths`
builds the first ones only (tensors of the others are skipped)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shoal.layers.attention import Attention
from shoal.layers.linear import ReplicatedLinear, load_tensor
from shoal.layers.norm import OffsetRMSNorm
from shoal.models.expert_weights import load_expert_tensors

PREFIX = "mtp."
_PACKED = {"gate_proj": 0, "up_proj": 1, "q_proj": "q", "k_proj": "k", "v_proj": "v"}
_DEPTH = re.compile(r"^layers\.(\d+)\.")


class Qwen3NextMTP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, target: nn.Module,
                 use_triton_ops: bool = True, depths: int = 1):
        """target: the main model (a Qwen3NextForCausalLM or subclass): its MLP kind, and
        its embedding and output head, which the layer shares. depths: the MTP layers run
        (the first ones)."""
        from shoal.models.qwen3_next import HybridDecoderLayer

        super().__init__()
        self.config = cfg
        self.num_depths = depths
        h, eps, ops = cfg.hidden_size, cfg.rms_norm_eps, use_triton_ops
        self.pre_fc_norm_embedding = OffsetRMSNorm(h, eps, dtype, ops)
        self.pre_fc_norm_hidden = OffsetRMSNorm(h, eps, dtype, ops)
        self.fc = ReplicatedLinear(2 * h, h, params_dtype=dtype)
        n = cfg.num_hidden_layers
        self.layers = nn.ModuleList([HybridDecoderLayer(
            cfg, dtype, n + j, interleaved=target.interleaved,
            sparse=target.sparse_layer(cfg, n + j), use_triton_ops=ops, kind="full_attention")
            for j in range(depths)])
        self.norm = OffsetRMSNorm(h, eps, dtype, ops)
        self._target = [target]  # (a list: not a submodule, its parameters are not ours)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                prev_hidden: torch.Tensor, md: Any, depth: int = 0) -> torch.Tensor:
        target = self._target[0]
        emb = self.pre_fc_norm_embedding(target.model.embed_tokens(input_ids))
        x = self.fc(torch.cat([emb, self.pre_fc_norm_hidden(prev_hidden)], dim=-1))
        out, residual = self.layers[depth](positions, x, None, md)
        hidden, _ = self.norm(out, residual)
        return hidden

    def compute_logits(self, hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        return self._target[0].compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint's mtp.* tensors; raises when one of the layer's parameters is left
        unfilled or a tensor has no parameter."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        own = ((n[len(PREFIX):], t) for n, t in weights
               if n.startswith(PREFIX) and self._runs(n[len(PREFIX):]))
        for name, tensor in load_expert_tensors(own, params, loaded, type(self).__name__):
            shard = None
            for src, sid in _PACKED.items():
                if f".{src}." in name:
                    dst = "gate_up_proj" if isinstance(sid, int) else "qkv_proj"
                    name, shard = name.replace(f".{src}.", f".{dst}."), sid
                    break
            param = params.get(name)
            if param is None:
                raise ValueError(f"MTP checkpoint tensor {PREFIX}{name} has no matching "
                                 f"parameter in {type(self).__name__}")
            load_tensor(param, tensor, shard)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"the checkpoint's MTP layer lacks {missing[:5]}")
        return loaded

    def _runs(self, name: str) -> bool:
        """Whether a tensor (mtp. stripped) belongs to a depth this head runs."""
        m = _DEPTH.match(name)
        return m is None or int(m[1]) < self.num_depths
