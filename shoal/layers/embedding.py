"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from shoal.distributed.parallel_state import (
    get_tp_rank,
    get_tp_world_size,
    tp_all_gather_last_dim,
    tp_all_reduce,
)
from shoal.layers.linear import default_weight_loader
from shoal.layers.ops import small_linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int,
                 params_dtype: torch.dtype | None = None):
        super().__init__()
        tp, rank = get_tp_world_size(), get_tp_rank()
        self.num_embeddings = num_embeddings
        self.shard = (num_embeddings + tp - 1) // tp  # the last shard is padded
        self.vocab_start = rank * self.shard
        self.vocab_end = min(self.vocab_start + self.shard, num_embeddings)
        self.tp_size = tp
        self.weight = nn.Parameter(torch.empty(self.shard, embedding_dim, dtype=params_dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        part = loaded[self.vocab_start:self.vocab_end]
        if part.shape[0] < self.shard:
            param.data.zero_()
            default_weight_loader(param.data[: part.shape[0]], part)
        else:
            default_weight_loader(param, part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(in_range, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * in_range.unsqueeze(-1)
        return tp_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits over the full vocabulary."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = small_linear.linear(hidden, self.weight)
        if self.tp_size > 1:
            logits = tp_all_gather_last_dim(logits)
        return logits[..., : self.num_embeddings]
