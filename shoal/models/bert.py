"""BERT encoders for pooling: `BertModel` (sentence embedders such as all-MiniLM-L6-v2) and
`BertForSequenceClassification` (classifiers and cross-encoder rerankers).

Encoder-only: bidirectional attention over whole prompts, no KV cache. The step's sequences
arrive packed back to back ([T] ids, [T] positions); attention metadata is a PackedSeqs
(shoal/attention/packed.py), which also carries the segment (token type) ids of pairs.
Module names follow the Hugging Face checkpoint; q/k/v are fused into one projection."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from shoal.attention.packed import PackedSeqs, packed_attention
from shoal.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    load_tensor,
    packed_target,
)
from shoal.layers.onednn_linear import fast_linear
from shoal.models.interface import PoolingModelBase, SequenceClassifierBase


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size,
                                                dtype=dtype)
        self.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), cfg.hidden_size,
                                                  dtype=dtype)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:  # segment 0 everywhere: one row, broadcast
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class _AddNorm(nn.Module):
    """dense, then LayerNorm of (dense output + residual): BERT's "output" blocks."""

    def __init__(self, d_in: int, d_out: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.dense = RowParallelLinear(d_in, d_out, bias=True, params_dtype=dtype)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(fast_linear(self.dense, x) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype):
        super().__init__()
        heads = cfg.num_attention_heads
        self.head_dim = cfg.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, heads, heads,
                                          bias=True, params_dtype=dtype)
        self.num_heads = self.qkv_proj.num_heads
        self.scale = self.head_dim ** -0.5
        self.output = _AddNorm(cfg.hidden_size, cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, seqs: PackedSeqs) -> torch.Tensor:
        t = hidden.shape[0]
        qkv = fast_linear(self.qkv_proj, hidden)
        q, k, v = qkv.view(t, 3, self.num_heads, self.head_dim).unbind(1)
        o = packed_attention(q, k, v, seqs, self.scale)
        return self.output(o.reshape(t, -1), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype):
        super().__init__()
        act = getattr(cfg, "hidden_act", "gelu")
        if act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"BERT hidden_act {act!r} is not supported (gelu only)")
        self.approximate = "none" if act == "gelu" else "tanh"
        self.dense = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=True,
                                          params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.approximate == "none":  # exact GELU fuses into the oneDNN linear
            return fast_linear(self.dense, x, gelu=True)
        return F.gelu(self.dense(x), approximate=self.approximate)


class BertLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype):
        super().__init__()
        self.attention = BertAttention(cfg, dtype)
        self.intermediate = BertIntermediate(cfg, dtype)
        self.output = _AddNorm(cfg.intermediate_size, cfg.hidden_size, cfg.layer_norm_eps, dtype)

    def forward(self, hidden: torch.Tensor, seqs: PackedSeqs) -> torch.Tensor:
        hidden = self.attention(hidden, seqs)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg, dtype) for _ in range(cfg.num_hidden_layers))

    def forward(self, hidden: torch.Tensor, seqs: PackedSeqs) -> torch.Tensor:
        for layer in self.layer:
            hidden = layer(hidden, seqs)
        return hidden


class BertModel(nn.Module, PoolingModelBase):
    """The encoder; pooled into embeddings by the pooling runner (CLS unless the
    sentence-transformers files say otherwise). A PoolingModel (shoal/models/interface.py):
    embed, token_embed, score."""

    is_causal = False
    default_pooling_type = "CLS"
    tie_word_embeddings = False
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "attention.self.query": ("attention.qkv_proj", "q"),
        "attention.self.key": ("attention.qkv_proj", "k"),
        "attention.self.value": ("attention.qkv_proj", "v"),
    }
    # checkpoint tensors with no use here (the MLM head, the unused NSP pooler, buffers)
    _ignored_prefixes = ("pooler.", "cls.", "embeddings.position_ids")

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__()
        self.config = hf_config
        self.hidden_size = hf_config.hidden_size
        self.embeddings = BertEmbeddings(hf_config, dtype)
        self.encoder = BertEncoder(hf_config, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: PackedSeqs) -> torch.Tensor:
        hidden = self.embeddings(input_ids, positions, attn_metadata.token_type_ids)
        return self.encoder(hidden, attn_metadata)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_bert_weights(self, weights, prefix="", ignored=self._ignored_prefixes,
                                 strip=self.checkpoint_prefix)

    checkpoint_prefix = "bert."  # what a task checkpoint puts before the encoder's names


class BertForSequenceClassification(nn.Module, SequenceClassifierBase):
    """BERT, its pooler (dense + tanh over the [CLS] token) and a linear classifier."""

    is_causal = False
    default_pooling_type = "CLS"
    classifier_pooling_type = "CLS"
    tie_word_embeddings = False
    packed_modules_mapping = BertModel.packed_modules_mapping

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__()
        self.config = hf_config
        self.hidden_size = hf_config.hidden_size
        self.num_labels = int(getattr(hf_config, "num_labels", 2))
        self.bert = BertModel(hf_config, dtype)
        self.pooler = nn.Linear(hf_config.hidden_size, hf_config.hidden_size, dtype=dtype)
        self.classifier = nn.Linear(hf_config.hidden_size, self.num_labels, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: PackedSeqs) -> torch.Tensor:
        return self.bert(input_ids, positions, attn_metadata)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] [CLS] states -> [N, num_labels] logits."""
        return self.classifier(torch.tanh(self.pooler(pooled)))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed = ((n.replace("bert.pooler.dense.", "pooler.", 1), t) for n, t in weights)
        return load_bert_weights(self, renamed, prefix="bert.", ignored=("cls.",
                                 "bert.embeddings.position_ids"))


def load_bert_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], *,
                      prefix: str, ignored: tuple[str, ...], strip: str = "bert.") -> set[str]:
    """HF-named tensors into `model`; q/k/v land in the fused projection. Checkpoints of the
    bare encoder sometimes carry the task prefix (`strip`: "bert.", "roberta."), and
    classifier checkpoints always do."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        if not prefix and name.startswith(strip):
            name = name[len(strip):]
        if name.startswith(ignored):
            continue
        target, shard = packed_target(name, BertModel.packed_modules_mapping)
        param = params.get(target)
        if param is None:
            raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                             f"{type(model).__name__}")
        load_tensor(param, tensor, shard)
        loaded.add(target)
    return loaded
