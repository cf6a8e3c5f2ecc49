"""More tensor-parallel ranks than KV heads through the Transformers backend
(transformers_backend/tensor_parallel.py): k_proj and v_proj are not split, each rank keeps
the KV head its query heads read (the engine on two ranks over one KV head:
test_transformers_backend_tp.py). What cannot be replicated (KV heads that do not divide the
ranks, KV heads inside a fused projection) is still refused by name."""

from __future__ import annotations

import pytest
import torch
from oracle import TINY_COMMON
from torch import nn
from transformers import AutoConfig

import shoal.layers.linear as linear
import shoal.models.transformers_backend.tensor_parallel as tensor_parallel
from shoal.models.transformers_backend.tensor_parallel import ReplicatedKVLinear, tp_plan


def test_each_rank_keeps_the_kv_head_of_its_query_heads(monkeypatch) -> None:
    """4 ranks over 2 KV heads of 3 rows: ranks 0, 1 keep head 0; ranks 2, 3 head 1."""
    whole = nn.Linear(8, 6, bias=True)
    weight = torch.arange(48.0).view(6, 8)
    bias = torch.arange(6.0)
    monkeypatch.setattr(linear, "get_tp_world_size", lambda: 4)
    monkeypatch.setattr(tensor_parallel, "get_tp_world_size", lambda: 4)
    for rank, head in ((0, 0), (1, 0), (2, 1), (3, 1)):
        monkeypatch.setattr(linear, "get_tp_rank", lambda r=rank: r)
        kv = ReplicatedKVLinear(whole, kv_heads=2)
        kv.weight.weight_loader(kv.weight, weight)
        kv.bias.weight_loader(kv.bias, bias)
        assert torch.equal(kv.weight, weight[3 * head:3 * head + 3])
        assert torch.equal(kv.bias, bias[3 * head:3 * head + 3])


def test_plans_with_kv_heads_fewer_than_ranks() -> None:
    cfg = AutoConfig.for_model("llama", **TINY_COMMON)  # 4 heads, 2 KV heads
    plan = tp_plan(cfg, 4)
    assert plan.splits_heads and plan.kv_replicas == 2
    assert tp_plan(cfg, 2).kv_replicas == 1
    odd = AutoConfig.for_model("llama", **{**TINY_COMMON, "hidden_size": 96,
                                           "num_attention_heads": 6, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match=r"its num_key_value_heads \(3\) is not divisible by "
                                         r"tensor_parallel_size \(2\) and does not divide it"):
        tp_plan(odd, 2)
    fused = AutoConfig.for_model("llama", **TINY_COMMON, base_model_tp_plan={
        "layers.*.self_attn.qkv_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise"})
    assert tp_plan(fused, 2).kv_replicas == 1
    with pytest.raises(ValueError, match="its KV heads sit in a fused projection"):
        tp_plan(fused, 4)
