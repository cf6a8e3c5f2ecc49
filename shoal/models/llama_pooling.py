"""Llama-family decoders as pooling models: `LlamaForSequenceClassification` (a linear
`score` head over the last token, as transformers has it). A plain `...ForCausalLM` used as
an embedder (runner="pooling") needs no class of its own: as_pooling_model
(shoal/models/interface.py) gives it the embedder's declarations, and the pooling runner takes
its final hidden states and never calls its lm_head."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.models.interface import SequenceClassifierBase
from shoal.models.llama import LlamaForCausalLM, Qwen2ForCausalLM


class LlamaForSequenceClassification(LlamaForCausalLM, SequenceClassifierBase):
    classifier_pooling_type = "LAST"

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        nn.Module.__init__(self)
        self.config = hf_config
        self.hidden_size = hf_config.hidden_size
        self.model = self._build_model(hf_config, dtype, use_triton_ops)
        self.tie_word_embeddings = False
        self.num_labels = int(getattr(hf_config, "num_labels", 2))
        self.score = nn.Linear(hf_config.hidden_size, self.num_labels, bias=False, dtype=dtype)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """[N, hidden] last-token states -> [N, num_labels] logits."""
        return self.score(pooled)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise ValueError("a sequence classification model has no language-model head")


class Qwen2ForSequenceClassification(LlamaForSequenceClassification):
    qkv_bias = Qwen2ForCausalLM.qkv_bias
