"""Pooling models with tensor parallelism (runner="pooling", tensor_parallel_size=2 on the CPU:
two processes joined by gloo, shoal/executor/multiproc.py): every rank runs a pooling runner
over its shard, rank 0 pools. A BERT embedder, a BERT cross-encoder (scores of text pairs,
with segment ids, and raw classifier logits), a Llama embedder (last token) and the same
Llama through the Transformers backend (its base_model_tp_plan) give on two ranks what one
rank gives (float32, 1e-5), rank 0 holding half of each split layer. What still cannot run is
refused by name before any rank starts: an encoder through the backend whose config has no
tensor-parallel plan (BERT), and an encoder split into pipeline stages (decoders run there:
test_pooling_pipeline_parallel.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import AutoConfig

from shoal import LLM
from shoal.engine.engine_args import EngineArgs
from shoal.layers.linear import ColumnParallelLinear, RowParallelLinear
from shoal.pooling_params import PoolingParams

# lengths 6, 2, 6, 3: a run of two equal lengths beside single ones (ids below the tiny
# Llama's vocabulary of 512)
PROMPTS = [{"prompt_token_ids": p} for p in
           ([101, 7, 300, 42, 99, 102], [101, 102], [101, 256, 3, 11, 400, 102], [101, 23, 102])]


def _on_ranks(path: Any, tp: int, run: Callable[[LLM], torch.Tensor],
              check_split: Callable[[Any], None] | None = None, **kwargs: Any) -> torch.Tensor:
    """`run`'s results of an engine of `tp` ranks; check_split(rank 0's model) at tp > 1."""
    llm = LLM(model=str(path), tensor_parallel_size=tp, device="cpu", dtype="float32",
              max_model_len=64, **kwargs)
    try:
        runner = llm.llm_engine.core.runner
        if tp > 1:
            assert type(runner).__name__ == "MultiprocExecutor" and runner.world == tp
            assert type(runner.driver).__name__ == "PoolingModelRunner"
            assert all(p.is_alive() for p in runner._procs)
            if check_split is not None:
                check_split(runner.driver.model)
        return run(llm)
    finally:
        llm.shutdown()


def _embed(llm: LLM) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in llm.embed(PROMPTS, use_tqdm=False)])


def _same_on_two_ranks(path: Any, run: Callable[[LLM], torch.Tensor],
                       check_split: Callable[[Any], None], **kwargs: Any) -> None:
    one = _on_ranks(path, 1, run, **kwargs)
    two = _on_ranks(path, 2, run, check_split, **kwargs)
    assert one.shape == two.shape
    assert len({tuple(row.tolist()) for row in one.reshape(len(one), -1)}) == len(one)
    torch.testing.assert_close(two, one, atol=1e-5, rtol=1e-5)


def _check_bert_split(model: Any) -> None:
    """4 heads of 8, an intermediate size of 64: halves on rank 0; embeddings whole."""
    layer = model.encoder.layer[0]
    assert layer.attention.num_heads == 2
    assert layer.attention.qkv_proj.weight.shape == (3 * 16, 32)
    assert layer.intermediate.dense.weight.shape == (32, 32)
    assert layer.output.dense.weight.shape == (32, 32)
    assert model.embeddings.word_embeddings.weight.shape == (30522, 32)


def test_bert_embeddings_on_two_ranks(tiny_bert) -> None:
    path, _ = tiny_bert
    _same_on_two_ranks(path, _embed, _check_bert_split)


def test_bert_cross_encoder_on_two_ranks(tiny_cross_encoder) -> None:
    """Scores of pairs (segment ids on every rank) and raw logits of the replicated head."""
    path, _ = tiny_cross_encoder
    docs = ["the weather is fine today", "a cat sits on the mat", "stocks fell sharply"]

    def run(llm: LLM) -> torch.Tensor:
        scores = [o.outputs.score for o in llm.score("how is the weather", docs,
                                                     use_tqdm=False)]
        raw = llm.encode(PROMPTS, PoolingParams(task="classify", use_activation=False),
                         use_tqdm=False)
        return torch.tensor(scores + [float(o.outputs.data[0]) for o in raw])

    _same_on_two_ranks(path, run, lambda model: _check_bert_split(model.bert))


def _check_llama_split(model: Any) -> None:
    """4 query heads and 2 KV heads of 16, an MLP of 128: halves on rank 0."""
    attn = model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    assert model.model.layers[0].mlp.down_proj.weight.shape == (64, 64)


def _check_backend_split(model: Any) -> None:
    layer = model.model.layers[0]
    assert type(model).__name__ == "TransformersForCausalLM"
    assert isinstance(layer.self_attn.q_proj, ColumnParallelLinear)
    assert isinstance(layer.mlp.down_proj, RowParallelLinear)
    assert layer.self_attn.q_proj.weight.shape == (32, 64)
    assert [(a.num_heads, a.num_kv_heads) for a in model.attention_layers()] == [(2, 1)] * 2
    assert not any(n.startswith("lm_head.") for n, _ in model.named_parameters())


@pytest.mark.parametrize("impl, check_split", [("auto", _check_llama_split),
                                               ("transformers", _check_backend_split)])
def test_llama_last_token_embeddings_on_two_ranks(tiny_llama_dir, impl, check_split) -> None:
    """A causal LM as an embedder: shoal's LlamaForCausalLM, and transformers' own through
    the backend with the config's base_model_tp_plan."""
    _same_on_two_ranks(tiny_llama_dir, _embed, check_split, runner="pooling", model_impl=impl)


def test_backend_encoder_splits_by_its_tp_plan(monkeypatch) -> None:
    """An encoder through the backend splits by its config's base_model_tp_plan too
    (EuroBERT's; shoal's own EuroBERT class bypassed). Built here as rank 0 of 2 with the
    collectives stubbed out (another engine pair would double this file's time): the split
    layers, rank 0's slices of the checkpoint and the probe's check of the local heads; the
    numbers of split layers on two ranks are what the engine tests above compare."""
    import torch.distributed as dist
    from oracle import randomize_weights
    from transformers import AutoModel

    from shoal.distributed import parallel_state
    from shoal.models.registry import resolve_model_class

    cfg = AutoConfig.for_model("eurobert", vocab_size=128, hidden_size=32, intermediate_size=64,
                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                               eos_token_id=2, mask_token_id=3)
    torch.manual_seed(0)
    hf = AutoModel.from_config(cfg, dtype=torch.float32).eval()
    randomize_weights(hf)
    hf.config.architectures = ["EuroBertModel"]
    monkeypatch.setattr(parallel_state, "_TP_GROUP", object())
    monkeypatch.setattr(parallel_state, "_TP_SIZE", 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "all_reduce", lambda x, group=None: None)
    model = resolve_model_class(hf.config, "pooling", "transformers")(hf.config, torch.float32)
    model.load_weights(hf.state_dict().items())
    attn, ref = model.layers[0].self_attn, hf.layers[0].self_attn
    assert type(model).__name__ == "TransformersEncoderModel"
    assert isinstance(attn.k_proj, ColumnParallelLinear)
    assert isinstance(model.layers[0].mlp.down_proj, RowParallelLinear)
    torch.testing.assert_close(attn.q_proj.weight, ref.q_proj.weight[:16])  # heads 0 and 1
    torch.testing.assert_close(attn.k_proj.weight, ref.k_proj.weight[:8])  # KV head 0
    torch.testing.assert_close(attn.o_proj.weight, ref.o_proj.weight[:, :16])
    torch.testing.assert_close(model.embed_tokens.weight, hf.embed_tokens.weight)  # whole


def test_what_cannot_split_is_refused_before_any_rank_starts(monkeypatch) -> None:
    bert = AutoConfig.for_model("bert", vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                num_attention_heads=4, intermediate_size=64,
                                max_position_embeddings=64)
    bert.architectures = ["BertModel"]
    # shoal's own BERT splits; through the backend, a config without a tp plan is refused
    assert EngineArgs(device="cpu", tensor_parallel_size=2, max_model_len=64
                      ).create_engine_config(bert).parallel_config.tensor_parallel_size == 2
    message = ("the Transformers backend cannot run BertModel with tensor_parallel_size 2: "
               "its config has no base_model_tp_plan")
    with pytest.raises(ValueError, match=message):
        EngineArgs(device="cpu", tensor_parallel_size=2, max_model_len=64,
                   model_impl="transformers").create_engine_config(bert)
    with pytest.raises(ValueError, match="BertModel is an encoder-only model, which runs in "
                                         "one stage"):
        EngineArgs(device="cpu", pipeline_parallel_size=2, max_model_len=64
                   ).create_engine_config(bert)
    # the backend's encoder class refuses it too, built on two ranks (as the layers see it)
    from shoal.models.transformers_backend import encoder

    monkeypatch.setattr(encoder, "get_tp_world_size", lambda: 2)
    with pytest.raises(ValueError, match=message):
        encoder.TransformersEncoderModel(bert, torch.float32)
