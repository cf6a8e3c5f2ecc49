"""DeepSeek-V3.2 (DeepseekV32ForCausalLM, deepseek-ai/DeepSeek-V3.2-Exp): DeepSeek-V3 whose
latent attention reads, per query, only the index_topk cached tokens a lightning indexer
picks (DeepSeek Sparse Attention, shoal/layers/sparse_indexer.py). The rest is V3: MLA, the
sigmoid group-limited router with its correction bias, shared experts, dense leading layers
(as mlp_layer_types lists them).

Each layer has two paged caches in the same block tables: the latent rows and the indexer's
key rows (attention_layers() lists both). Contexts up to index_topk read every token, so the
layer is exactly dense MLA there (on any backend); longer ones read the indexer's picks
through sparse MLA: masks on the torch backend, a Triton kernel over each row's picked
positions on the Triton one (shoal/attention/ops/mla_sparse.py). Decode steps replay CUDA
graphs captured per block-table width (decode_table_buckets_from), so a short context skips
the indexer in its graph too and a long one scores its width's positions only."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from shoal.layers.latent_attention import LatentAttention
from shoal.layers.sparse_indexer import LightningIndexer, SparseSelection
from shoal.models.deepseek_v2 import (
    DeepseekDecoderLayer,
    DeepseekMLA,
    DeepseekModel,
    DeepseekV3ForCausalLM,
)


def is_sparse(cfg: Any) -> bool:
    """A DeepSeek config with the sparse-attention indexer (V3.2)."""
    return getattr(cfg, "index_topk", None) is not None


class DeepseekV32MLA(DeepseekMLA):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        if not getattr(cfg, "q_lora_rank", None):
            raise ValueError("DeepSeek-V3.2's indexer reads the query latent: q_lora_rank "
                             "must be set")
        super().__init__(cfg, dtype, use_triton_ops)
        self.indexer = LightningIndexer(cfg, dtype, use_triton_ops)

    def select(self, hidden: torch.Tensor, q_resid: torch.Tensor | None,
               positions: torch.Tensor, md: Any) -> SparseSelection | None:
        return self.indexer(hidden, q_resid, positions, md)


class DeepseekV32DecoderLayer(DeepseekDecoderLayer):
    attention_cls: ClassVar[type[DeepseekMLA]] = DeepseekV32MLA


class DeepseekV32Model(DeepseekModel):
    layer_cls: ClassVar[type[DeepseekDecoderLayer]] = DeepseekV32DecoderLayer


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__(hf_config, dtype, use_triton_ops=use_triton_ops)
        # In a CUDA graph the indexer scores every position its block tables could hold, and
        # is skipped only when they hold at most index_topk (sparse_indexer.py _pick_rows:
        # max_seq_len there is the tables' capacity). Decode graphs are captured per table
        # width, doubling from index_topk tokens (shoal/worker/model_graphs.py), and a step
        # replays the narrowest holding its longest request: within top-k (block_size
        # dividing it) no indexer runs and the attention is dense MLA, past it only the
        # width's positions are scored, not max_model_len's. The checkpoint's index_topk,
        # hence an instance attribute (graph_capture.py reads it off the model).
        self.decode_table_buckets_from: int = hf_config.index_topk

    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> nn.Module:
        return DeepseekV32Model(hf_config, dtype, use_triton_ops)

    def attention_layers(self) -> list[LatentAttention | LightningIndexer]:  # type: ignore[override]
        """Each layer's latent attention, then its indexer (both keep a row per token)."""
        out: list[LatentAttention | LightningIndexer] = []
        for layer in self.model.layers:
            out += [layer.self_attn.attn, layer.self_attn.indexer]
        return out
