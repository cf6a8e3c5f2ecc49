"""Every registered architecture follows shoal/models/interface.py: constructor arguments,
forward / compute_logits / attention_layers, load_weights filling every parameter from the
checkpoint's own names, and use_triton_ops reaching every layer that has a kernel. Every
pooling architecture, and every causal LM run as an embedder, is a PoolingModel whose
declarations (tasks, classifier, per-token heads) agree with what it defines."""

from __future__ import annotations

import inspect
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from oracle import TINY_COMMON
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM

from shoal.attention.linear_state import build_state_metadata
from shoal.attention.metadata import GroupedMetadata, build_attention_metadata
from shoal.attention.packed import PackedSeqs
from shoal.core.kv_cache_spec import group_layers
from shoal.layers.attention import Attention
from shoal.layers.latent_attention import LatentAttention
from shoal.layers.linear_attention import LinearAttention
from shoal.layers.paged_rows import PagedRows
from shoal.layers.sparse_indexer import LightningIndexer
from shoal.loader.build import check_all_loaded
from shoal.loader.dummy import initialize_dummy_weights
from shoal.models.interface import (
    EMBED_TASKS,
    CausalLM,
    PoolingModel,
    PoolingModelBase,
    as_pooling_model,
)
from shoal.models.registry import (
    resolve_model_class,
    supported_architectures,
    supported_pooling_architectures,
)
from shoal.pooling.model_info import POOLING_TYPES
from shoal.pooling_params import POOLING_TASKS
from shoal.worker.kv_cache_tensors import allocate_kv_caches, layer_specs

# The tiny Gated DeltaNet hybrids' fields: a linear layer, then a full-attention one.
HYBRID = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "full_attention"])

# architecture -> (transformers model_type, config fields beyond the tiny common ones)
ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", {}),
    "MistralForCausalLM": ("mistral", {}),
    "Qwen2ForCausalLM": ("qwen2", {}),
    "Qwen3ForCausalLM": ("qwen3", {"head_dim": 16}),
    "MixtralForCausalLM": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "Phi3ForCausalLM": ("phi3", {"pad_token_id": 0}),
    "GraniteForCausalLM": ("granite", {}),
    "GraniteMoeForCausalLM": ("granitemoe", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "SmolLM3ForCausalLM": ("smollm3", {"pad_token_id": 0}),
    "Olmo2ForCausalLM": ("olmo2", {}),
    # (pooling steps cannot soft-cap attention: the embedder check runs without the cap)
    "Gemma2ForCausalLM": ("gemma2", {"head_dim": 16, "attn_logit_softcapping": None}),
    "Glm4ForCausalLM": ("glm4", {"head_dim": 16, "pad_token_id": 0}),
    "Glm4MoeForCausalLM": ("glm4_moe", {"head_dim": 16, "pad_token_id": 0, "use_qk_norm": True,
                                        "n_routed_experts": 4, "num_experts_per_tok": 2,
                                        "moe_intermediate_size": 32, "n_shared_experts": 1,
                                        "first_k_dense_replace": 1, "n_group": 2,
                                        "topk_group": 1}),
    "Starcoder2ForCausalLM": ("starcoder2", {}),
    "CohereForCausalLM": ("cohere", {"use_qk_norm": True}),
    "Qwen3MoeForCausalLM": ("qwen3_moe", {"head_dim": 16, "num_experts": 4,
                                          "num_experts_per_tok": 2,
                                          "moe_intermediate_size": 32}),
    "DeepseekV2ForCausalLM": ("deepseek_v2", {"kv_lora_rank": 32, "q_lora_rank": None,
                                              "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                                              "v_head_dim": 16, "n_routed_experts": 4,
                                              "num_experts_per_tok": 2, "n_shared_experts": 1,
                                              "moe_intermediate_size": 32,
                                              "first_k_dense_replace": 1}),
    "DeepseekV3ForCausalLM": ("deepseek_v3", {"kv_lora_rank": 32, "q_lora_rank": 24,
                                              "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                                              "v_head_dim": 16, "n_routed_experts": 4,
                                              "num_experts_per_tok": 2, "n_shared_experts": 1,
                                              "n_group": 2, "topk_group": 1,
                                              "moe_intermediate_size": 32,
                                              "first_k_dense_replace": 1}),
    "DeepseekV32ForCausalLM": ("deepseek_v32", {"kv_lora_rank": 32, "q_lora_rank": 24,
                                                "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
                                                "v_head_dim": 16, "n_routed_experts": 4,
                                                "num_experts_per_tok": 2, "n_shared_experts": 1,
                                                "n_group": 2, "topk_group": 1,
                                                "moe_intermediate_size": 32,
                                                "first_k_dense_replace": 1, "index_n_heads": 4,
                                                "index_head_dim": 32, "index_topk": 8}),
    **{arch: (model_type, {**HYBRID, **extra}) for arch, (model_type, extra) in {
        "Qwen3NextForCausalLM": ("qwen3_next", {
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32, "mlp_only_layers": [1]}),
        "Qwen3_5ForCausalLM": ("qwen3_5_text", {}),
        "Qwen3_5MoeForCausalLM": ("qwen3_5_moe_text", {
            "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32}),
    }.items()},
    "KimiLinearForCausalLM": ("kimi_linear", {
        "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None,
        "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "moe_intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "pad_token_id": 0,
        "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2], "head_dim": 16,
                               "num_heads": 2, "short_conv_kernel_size": 4}}),
    "Gemma3ForCausalLM": ("gemma3_text", {"head_dim": 16}),
    "GptOssForCausalLM": ("gpt_oss", {"head_dim": 16, "num_local_experts": 4,
                                      "num_experts_per_tok": 2, "intermediate_size": 32,
                                      "sliding_window": 4}),
    "DeepseekV4ForCausalLM": ("deepseek_v4", {
        "num_key_value_heads": 1, "head_dim": 16, "q_lora_rank": 24,
        "partial_rotary_factor": 0.5, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "layer_types": ["compressed_sparse_attention", "heavily_compressed_attention"],
        "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        "mlp_layer_types": ["hash_moe", "moe"], "hc_mult": 2, "sliding_window": 4,
        "o_groups": 2, "o_lora_rank": 8, "index_n_heads": 2, "index_head_dim": 16,
        "index_topk": 1}),
}
# Architectures with more than one paged layer per decoder layer (V3.2: latent attention and
# its indexer's keys; V4's CSA / HCA layers: the window's rows, the compressed entries and the
# compressor's partial group).
PAGED_LAYERS_PER_LAYER = {"DeepseekV32ForCausalLM": 2, "DeepseekV4ForCausalLM": 3}
# Architectures with linear-attention layers beside attention ones.
LINEAR = {"Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM",
          "KimiLinearForCausalLM"}


# Vision-language models: checked against transformers in tests/multimodal (their configs
# nest a vision config), and here for the multimodal interface.
MULTIMODAL = ("Gemma3ForConditionalGeneration", "Idefics3ForConditionalGeneration",
              "LlavaForConditionalGeneration",
              "Qwen2_5_VLForConditionalGeneration", "Qwen3VLForConditionalGeneration",
              "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


def test_every_registered_architecture_is_checked() -> None:
    assert sorted([*ARCHITECTURES, *MULTIMODAL]) == supported_architectures()


@pytest.mark.parametrize("arch", MULTIMODAL)
def test_multimodal_signatures(arch: str) -> None:
    from shoal.models.interface import SupportsMultiModal

    cls = resolve_model_class(SimpleNamespace(architectures=[arch], model_type=None))
    assert cls.__name__ == arch and cls.supports_multimodal
    assert list(inspect.signature(cls.forward).parameters)[1:] == [
        "input_ids", "positions", "attn_metadata", "inputs_embeds"]
    assert list(inspect.signature(cls.embed_input_ids).parameters)[1:] == [
        "input_ids", "mm_embeds", "is_multimodal"]
    for name in ("embed_multimodal", "get_mrope_positions", "compute_logits",
                 "attention_layers", "load_weights"):
        assert callable(getattr(cls, name))
    assert issubclass(cls, nn.Module) and SupportsMultiModal.__name__


def _config(arch: str):
    model_type, extra = ARCHITECTURES[arch]
    return AutoConfig.for_model(model_type, **{**TINY_COMMON, **extra}, architectures=[arch])


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_signatures(arch: str) -> None:
    cls = resolve_model_class(_config(arch))
    assert cls.__name__ == arch and issubclass(cls, nn.Module)
    init = inspect.signature(cls.__init__).parameters
    assert list(init)[1:3] == ["hf_config", "dtype"]
    assert init["use_triton_ops"].kind is inspect.Parameter.KEYWORD_ONLY
    assert init["use_triton_ops"].default is True
    assert list(inspect.signature(cls.forward).parameters)[1:] == [
        "input_ids", "positions", "attn_metadata"]
    for src, (dst, shard) in cls.packed_modules_mapping.items():
        assert isinstance(src, str) and isinstance(dst, str) and isinstance(shard, str | int)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_model_follows_the_interface(arch: str) -> None:
    cfg = _config(arch)
    torch.manual_seed(0)
    model = resolve_model_class(cfg)(cfg, torch.float32, use_triton_ops=False)
    assert isinstance(model, CausalLM)
    flags = [m.use_triton_ops for m in model.modules() if hasattr(m, "use_triton_ops")]
    assert flags and not any(flags)

    # transformers' own parameter names, as a checkpoint stores them, fill every parameter.
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    check_all_loaded(model, model.load_weights(hf.state_dict().items()), arch)

    layers = model.attention_layers()
    per_layer = PAGED_LAYERS_PER_LAYER.get(arch, 1)
    assert len(layers) == per_layer * cfg.num_hidden_layers
    kinds = ((Attention, LatentAttention, LightningIndexer, PagedRows)
             + ((LinearAttention,) if arch in LINEAR else ()))
    assert all(isinstance(a, kinds) for a in layers)
    n = 5
    bs = type(model).block_size_for(cfg, 4, 1) if arch in LINEAR else 4
    specs = layer_specs(layers, torch.float32)
    groups = group_layers(specs)
    allocate_kv_caches(layers, specs, groups, 3 * bs, torch.float32, torch.device("cpu"), bs)
    md = GroupedMetadata.of_groups([
        (build_state_metadata if g.holds_state else partial(build_attention_metadata,
                                                            sliding_window=None))(
            query_lens=[n], context_lens=[0], block_tables=[[0, 1]], block_size=bs,
            num_decodes=0, device=torch.device("cpu"), null_block=2) for g in groups])
    with torch.inference_mode():
        hidden = model(torch.arange(3, 3 + n), torch.arange(n), md)
        logits = model.compute_logits(hidden)
    assert hidden.shape == (n, cfg.hidden_size)
    assert logits.shape == (n, cfg.vocab_size) and torch.isfinite(logits).all()


# ---- pooling models (runner="pooling") ---------------------------------------------------------

# architecture -> (transformers model_type, config fields); BERT-sized tiny shapes
_ENCODER = dict(vocab_size=512, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=64, max_position_embeddings=64)
_EUROBERT = {**TINY_COMMON, "pad_token_id": 0, "mask_token_id": 3}
POOLING_ARCHITECTURES = {
    "BertModel": ("bert", _ENCODER),
    "BertForSequenceClassification": ("bert", {**_ENCODER, "num_labels": 3}),
    "RobertaModel": ("roberta", {**_ENCODER, "pad_token_id": 1}),
    "XLMRobertaModel": ("xlm-roberta", {**_ENCODER, "pad_token_id": 1}),
    "BgeM3EmbeddingModel": ("xlm-roberta", {**_ENCODER, "pad_token_id": 1}),
    "RobertaForSequenceClassification": ("roberta", {**_ENCODER, "pad_token_id": 1,
                                                     "num_labels": 1}),
    "XLMRobertaForSequenceClassification": ("xlm-roberta", {**_ENCODER, "pad_token_id": 1,
                                                           "num_labels": 2}),
    "LlamaForSequenceClassification": ("llama", {**TINY_COMMON, "num_labels": 2}),
    "Qwen2ForSequenceClassification": ("qwen2", {**TINY_COMMON, "num_labels": 1}),
    "EuroBertModel": ("eurobert", _EUROBERT),
    "EuroBertForMaskedLM": ("eurobert", _EUROBERT),
    # (this check admits CLS or LAST classifiers: "bos"; "mean" and "late": test_eurobert.py)
    "EuroBertForSequenceClassification": ("eurobert", {**_EUROBERT, "num_labels": 2,
                                                       "classifier_pooling": "bos"}),
    "JinaEmbeddingsV5Model": ("eurobert", {**_EUROBERT, "is_decoder": False}),
}
# Causal LMs run as embedders (latent attention is refused under pooling: the compatibility
# table's row, shoal/engine/compatibility.py).
EMBEDDERS = sorted(a for a, (_, extra) in ARCHITECTURES.items()
                   if "kv_lora_rank" not in extra and a not in LINEAR)


def test_every_registered_pooling_architecture_is_checked() -> None:
    assert sorted(POOLING_ARCHITECTURES) == supported_pooling_architectures()


def _pooling_config(arch: str):
    if arch in POOLING_ARCHITECTURES:
        model_type, fields = POOLING_ARCHITECTURES[arch]
        return AutoConfig.for_model(model_type, **fields, architectures=[arch])
    return _config(arch)


def _check_declarations(model: PoolingModel) -> None:
    tasks = model.pooling_tasks
    assert tasks and set(tasks) <= set(POOLING_TASKS)
    assert model.default_pooling_type in POOLING_TYPES and isinstance(model.is_causal, bool)
    classifier = "classify" in tasks
    assert classifier == (model.num_labels > 0) == (model.classifier_pooling_type is not None)
    # a classifier defines its head, a model with per-token heads its token_output
    assert classifier == (type(model).classify is not PoolingModelBase.classify)
    assert model.has_token_heads == (type(model).token_output is not PoolingModelBase.token_output)
    if classifier:
        assert model.classifier_pooling_type in ("CLS", "LAST", "MEAN")
        assert ("score" in tasks) == (model.num_labels == 1)  # a cross-encoder
    else:
        assert set(EMBED_TASKS) <= set(tasks)


@pytest.mark.parametrize("arch", sorted(POOLING_ARCHITECTURES) + EMBEDDERS)
def test_pooling_model_follows_the_interface(arch: str) -> None:
    cfg = _pooling_config(arch)
    cls = as_pooling_model(resolve_model_class(cfg, "pooling"))
    assert cls.__name__ == arch and issubclass(cls, PoolingModelBase)
    assert as_pooling_model(cls) is cls
    torch.manual_seed(0)
    model = cls(cfg, torch.float32, use_triton_ops=False)
    initialize_dummy_weights(model, seed=0)
    assert isinstance(model, PoolingModel)
    _check_declarations(model)
    if arch in EMBEDDERS:  # the embedder's declarations over the causal LM
        assert model.is_causal and model.default_pooling_type == "LAST"
        assert tuple(model.pooling_tasks) == EMBED_TASKS
    lens = [3, 2]
    seqs = PackedSeqs.build(lens, model.is_causal, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(torch.arange(3, 3 + sum(lens)), torch.cat([torch.arange(n) for n in lens]),
                       seqs)
        assert hidden.shape == (sum(lens), model.hidden_size) and torch.isfinite(hidden).all()
        if "classify" in model.pooling_tasks:
            assert model.classify(hidden[:2]).shape == (2, model.num_labels)
        for task in ("token_embed", "token_classify"):
            if model.has_token_heads and task in model.pooling_tasks:
                assert torch.isfinite(model.token_output(task, hidden[:3])).all()
    if type(model).load_extra_files is PoolingModelBase.load_extra_files:
        assert model.load_extra_files(Path("/nonexistent")) == set()  # nothing beside
