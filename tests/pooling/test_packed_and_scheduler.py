"""Packed varlen attention against a per-sequence reference, and the pooling scheduler:
whole prompts, no KV blocks, the token budget and sequence limit respected, one step each."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shoal.attention.packed import PackedSeqs, packed_attention
from shoal.config import SchedulerConfig
from shoal.core.request import Request
from shoal.core.scheduler_output import ModelRunnerOutput
from shoal.engine.pooling_scheduler import PoolingScheduler
from shoal.pooling_params import PoolingParams
from shoal.sampling_params import SamplingParams


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_attention_matches_each_sequence_alone(causal, kv_heads):
    torch.manual_seed(0)
    lens = [5, 1, 7, 5, 3]
    t = sum(lens)
    q, k, v = torch.randn(t, 4, 8), torch.randn(t, kv_heads, 8), torch.randn(t, kv_heads, 8)
    got = packed_attention(q, k, v, PackedSeqs.build(lens, causal, torch.device("cpu")), 0.3)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        kk = k[sl].repeat_interleave(4 // kv_heads, 1)
        vv = v[sl].repeat_interleave(4 // kv_heads, 1)
        ref = F.scaled_dot_product_attention(q[sl].transpose(0, 1), kk.transpose(0, 1),
                                             vv.transpose(0, 1), is_causal=causal, scale=0.3)
        torch.testing.assert_close(got[sl], ref.transpose(0, 1), atol=1e-5, rtol=1e-5)
        start += n


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=1), frozenset(), 1,
                   arrival_time=time.monotonic(), pooling_params=PoolingParams())


def test_pooling_scheduler_packs_whole_prompts_without_kv_blocks():
    sched = PoolingScheduler(SchedulerConfig(max_num_batched_tokens=20, max_num_seqs=3,
                                             max_model_len=20))
    for i, n in enumerate([8, 8, 8, 2, 2, 2, 2]):
        sched.add_request(_req(str(i), n))
    seen = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        assert out.num_scheduled_tokens <= 20 and len(out.scheduled) <= 3
        assert all(s.block_ids == [] and s.context_len == 0 for s in out.scheduled)
        assert all(s.num_new_tokens == len(sched.requests[s.request_id].prompt_token_ids)
                   for s in out.scheduled)  # never chunked
        result = ModelRunnerOutput(pooled={s.serial: np.zeros(2, np.float32)
                                           for s in out.scheduled})
        outs = sched.update(out, result)
        assert all(o.finish_reason == "stop" and o.pooled_shape == [2] for o in outs)
        seen.append([s.request_id for s in out.scheduled])
    assert seen == [["0", "1"], ["2", "3", "4"], ["5", "6"]]
    assert sched.stats().kv_cache_usage == 0


def test_pooling_scheduler_fails_a_non_finite_result_alone():
    sched = PoolingScheduler(SchedulerConfig(max_num_batched_tokens=64, max_model_len=32))
    sched.add_request(_req("a", 4))
    sched.add_request(_req("b", 4))
    out = sched.schedule()
    serial_a = out.scheduled[0].serial

    outs = sched.update(out, ModelRunnerOutput(pooled={serial_a: np.ones(2, np.float32)},
                                               failed_serials={out.scheduled[1].serial}))
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "stop"), ("b", "error")]
    assert not sched.has_unfinished_requests()


def test_pooling_scheduler_needs_whole_prompts_to_fit_a_step():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        PoolingScheduler(SchedulerConfig(max_num_batched_tokens=16, max_model_len=32))


@pytest.mark.parametrize("arch", ["BertModel", "BertForSequenceClassification",
                                  "LlamaForSequenceClassification",
                                  "Qwen2ForSequenceClassification", "XLMRobertaModel",
                                  "XLMRobertaForSequenceClassification", "RobertaModel"])
def test_pooling_architectures_load_every_parameter_from_transformers_names(arch):
    from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

    from shoal.loader.build import check_all_loaded
    from shoal.models.registry import resolve_model_class, supported_pooling_architectures

    assert arch in supported_pooling_architectures()
    model_type = {"Bert": "bert", "Llam": "llama", "Qwen": "qwen2", "XLMR": "xlm-roberta",
                  "Robe": "roberta"}[arch[:4]]
    cfg = AutoConfig.for_model(model_type, vocab_size=128, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                               num_labels=2, architectures=[arch])
    hf = (AutoModel.from_config(cfg, add_pooling_layer=False) if arch.endswith("Model")
          else AutoModelForSequenceClassification.from_config(cfg))
    cls = resolve_model_class(cfg, "pooling")
    assert cls.__name__ == arch
    model = cls(cfg, torch.float32)
    check_all_loaded(model, model.load_weights(hf.state_dict().items()), arch)
    with pytest.raises(ValueError, match="runner='pooling'"):
        resolve_model_class(cfg, "generate")
