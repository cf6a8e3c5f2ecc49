"""RoBERTa and XLM-RoBERTa encoders (e5, bge-m3's backbone, bge-reranker...): BERT with
positions counted from padding_idx + 1 and a two-layer classification head."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shoal.attention.packed import PackedSeqs
from shoal.models.bert import BertModel, load_bert_weights
from shoal.models.interface import SequenceClassifierBase


def position_offset(hf_config: Any) -> int:
    """RoBERTa numbers positions after the padding index: the first token is pad_id + 1."""
    return int(getattr(hf_config, "pad_token_id", 1) or 0) + 1


class RobertaModel(BertModel):
    checkpoint_prefix = "roberta."

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__(hf_config, dtype, use_triton_ops=use_triton_ops)
        self.position_offset = position_offset(hf_config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: PackedSeqs) -> torch.Tensor:
        return super().forward(input_ids, positions + self.position_offset, attn_metadata)


class RobertaClassificationHead(nn.Module):
    def __init__(self, hidden: int, num_labels: int, dtype: torch.dtype):
        super().__init__()
        self.dense = nn.Linear(hidden, hidden, dtype=dtype)
        self.out_proj = nn.Linear(hidden, num_labels, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class RobertaForSequenceClassification(nn.Module, SequenceClassifierBase):
    """The encoder and a dense + tanh + projection head over the <s> token."""

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
        self.roberta = RobertaModel(hf_config, dtype)
        self.classifier = RobertaClassificationHead(hf_config.hidden_size, self.num_labels,
                                                    dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: PackedSeqs) -> torch.Tensor:
        return self.roberta(input_ids, positions, attn_metadata)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(pooled)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_bert_weights(self, weights, prefix="roberta.",
                                 ignored=("roberta.embeddings.position_ids", "roberta.pooler.",
                                          "lm_head."))


class XLMRobertaModel(RobertaModel):
    pass


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    pass
