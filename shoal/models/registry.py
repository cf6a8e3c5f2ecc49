"""Model classes by the `architectures` name in a Hugging Face config, imported lazily.

Adding an architecture: a class that follows shoal/models/interface.py, one line here (and
one in _BY_MODEL_TYPE), and its entry in tests/models/test_interface.py.

An architecture without a class here runs through the Transformers backend
(shoal/models/transformers_backend: transformers' modeling code, shoal's paged attention)
when its modeling code allows it; model_impl picks the path (MODEL_IMPLS)."""

from __future__ import annotations

import importlib
from typing import Any

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("shoal.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("shoal.models.llama", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("shoal.models.llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("shoal.models.qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("shoal.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Qwen3NextForCausalLM": ("shoal.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("shoal.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("shoal.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    "DeepseekV2ForCausalLM": ("shoal.models.deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("shoal.models.deepseek_v2", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("shoal.models.deepseek_v32", "DeepseekV32ForCausalLM"),
    "DeepseekV4ForCausalLM": ("shoal.models.deepseek_v4", "DeepseekV4ForCausalLM"),
    "KimiLinearForCausalLM": ("shoal.models.kimi_linear", "KimiLinearForCausalLM"),
    "GptOssForCausalLM": ("shoal.models.gpt_oss", "GptOssForCausalLM"),
    "MixtralForCausalLM": ("shoal.models.mixtral", "MixtralForCausalLM"),
    "Phi3ForCausalLM": ("shoal.models.phi3", "Phi3ForCausalLM"),
    "GraniteForCausalLM": ("shoal.models.granite", "GraniteForCausalLM"),
    "GraniteMoeForCausalLM": ("shoal.models.granitemoe", "GraniteMoeForCausalLM"),
    "SmolLM3ForCausalLM": ("shoal.models.smollm3", "SmolLM3ForCausalLM"),
    "Olmo2ForCausalLM": ("shoal.models.olmo2", "Olmo2ForCausalLM"),
    "Gemma2ForCausalLM": ("shoal.models.gemma2", "Gemma2ForCausalLM"),
    "Glm4ForCausalLM": ("shoal.models.glm4", "Glm4ForCausalLM"),
    "Glm4MoeForCausalLM": ("shoal.models.glm4_moe", "Glm4MoeForCausalLM"),
    "Starcoder2ForCausalLM": ("shoal.models.starcoder2", "Starcoder2ForCausalLM"),
    "CohereForCausalLM": ("shoal.models.cohere", "CohereForCausalLM"),
    # vision-language models (images in: shoal/multimodal)
    "Qwen2_5_VLForConditionalGeneration": ("shoal.models.qwen2_5_vl",
                                           "Qwen2_5_VLForConditionalGeneration"),
    "Idefics3ForConditionalGeneration": ("shoal.models.idefics3",
                                         "Idefics3ForConditionalGeneration"),
    "Qwen3VLForConditionalGeneration": ("shoal.models.qwen3_vl",
                                        "Qwen3VLForConditionalGeneration"),
    "Qwen3_5ForConditionalGeneration": ("shoal.models.qwen3_5_vl",
                                        "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("shoal.models.qwen3_5_vl",
                                           "Qwen3_5MoeForConditionalGeneration"),
    "LlavaForConditionalGeneration": ("shoal.models.llava", "LlavaForConditionalGeneration"),
    "Gemma3ForCausalLM": ("shoal.models.gemma3", "Gemma3ForCausalLM"),
    "Gemma3ForConditionalGeneration": ("shoal.models.gemma3_vl",
                                       "Gemma3ForConditionalGeneration"),
}

# The Transformers modeling backend's class (model_impl="transformers", or "auto" for an
# architecture none of the tables below has).
TRANSFORMERS_BACKEND = ("shoal.models.transformers_backend.model", "TransformersForCausalLM")
# auto: shoal's own class when it has one, else the Transformers backend
MODEL_IMPLS = ("auto", "shoal", "transformers")

# Pooling-only architectures (encoders, classification heads): runner="pooling".
_POOLING_MODELS: dict[str, tuple[str, str]] = {
    "BertModel": ("shoal.models.bert", "BertModel"),
    "BertForSequenceClassification": ("shoal.models.bert", "BertForSequenceClassification"),
    "RobertaModel": ("shoal.models.roberta", "RobertaModel"),
    "XLMRobertaModel": ("shoal.models.roberta", "XLMRobertaModel"),
    "BgeM3EmbeddingModel": ("shoal.models.bge_m3", "BgeM3EmbeddingModel"),
    "RobertaForSequenceClassification": ("shoal.models.roberta",
                                         "RobertaForSequenceClassification"),
    "XLMRobertaForSequenceClassification": ("shoal.models.roberta",
                                            "XLMRobertaForSequenceClassification"),
    "LlamaForSequenceClassification": ("shoal.models.llama_pooling",
                                       "LlamaForSequenceClassification"),
    "Qwen2ForSequenceClassification": ("shoal.models.llama_pooling",
                                       "Qwen2ForSequenceClassification"),
    "EuroBertModel": ("shoal.models.eurobert", "EuroBertModel"),
    "EuroBertForMaskedLM": ("shoal.models.eurobert", "EuroBertForMaskedLM"),
    "EuroBertForSequenceClassification": ("shoal.models.eurobert",
                                          "EuroBertForSequenceClassification"),
    "JinaEmbeddingsV5Model": ("shoal.models.eurobert", "JinaEmbeddingsV5Model"),
}

# model_type -> architecture, for configs that do not list `architectures`.
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
    "deepseek_v4": "DeepseekV4ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "cohere": "CohereForCausalLM",
    "bert": "BertModel",
    "roberta": "RobertaModel",
    "xlm-roberta": "XLMRobertaModel",
    "eurobert": "EuroBertModel",
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def supported_pooling_architectures() -> list[str]:
    return sorted(_POOLING_MODELS)


def _architectures(hf_config: Any) -> list[str]:
    archs = list(getattr(hf_config, "architectures", None) or [])
    mt = getattr(hf_config, "model_type", None)
    if not archs and mt in _BY_MODEL_TYPE:
        archs = [_BY_MODEL_TYPE[mt]]
    return archs


def has_linear_attention(hf_config: Any) -> bool:
    """Linear-attention layers (Gated DeltaNet, KDA) beside attention ones: Qwen3-Next,
    Qwen3.5, Kimi Linear."""
    return "linear_attention" in (getattr(hf_config, "layer_types", None) or ())


def is_pooling_only(hf_config: Any) -> bool:
    """An encoder or a classification head: it cannot generate (runner "auto" -> pooling).
    Also an encoder-only model that only the Transformers backend runs."""
    archs = _architectures(hf_config)
    if any(a in _POOLING_MODELS for a in archs) and not any(a in _MODELS for a in archs):
        return True
    if not uses_transformers_backend(hf_config):
        return False
    from shoal.models.transformers_backend.support import is_encoder_only

    return is_encoder_only(hf_config)


def uses_transformers_backend(hf_config: Any, runner: str = "generate",
                              model_impl: str = "auto") -> bool:
    """Whether the model takes the Transformers backend: always for model_impl
    "transformers", for "auto" when shoal has no class for the architecture (under
    runner="pooling" the backend embeds with a decoder's hidden states), never for
    "shoal"."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)} (got "
                         f"{model_impl!r})")
    if model_impl != "auto":
        return model_impl == "transformers"
    archs = _architectures(hf_config)
    if not archs and not getattr(hf_config, "model_type", None):
        return False  # names no model at all: resolve_model_class's error, when built
    return not any(a in _MODELS or a in _POOLING_MODELS for a in archs)


def takes_transformers_backend(hf_config: Any, runner: str, model_impl: str) -> bool:
    """uses_transformers_backend, where the backend's checks on the config must pass: a
    model it cannot run raises ValueError naming why."""
    if not uses_transformers_backend(hf_config, runner, model_impl):
        return False
    _transformers_backend(hf_config, runner, model_impl)
    return True


def model_path(cls: type) -> str:
    """How a model class runs, for start-up logs."""
    if cls.__module__.startswith("shoal.models.transformers_backend."):
        # encoders whose code takes no custom attention run padded batches instead (the
        # encoder logs which path it took)
        return "the Transformers backend (transformers' modeling code)"
    return "shoal's own model class"


def resolve_model_class(hf_config: Any, runner: str = "generate",
                        model_impl: str = "auto") -> type:
    """The class for the config's architecture; runner "pooling" also takes the pooling-only
    ones (a causal LM serves as an embedder under it as well). model_impl: MODEL_IMPLS."""
    if uses_transformers_backend(hf_config, runner, model_impl):
        return _transformers_backend(hf_config, runner, model_impl)
    archs = _architectures(hf_config)
    tables = [_POOLING_MODELS, _MODELS] if runner == "pooling" else [_MODELS]
    for table in tables:
        for arch in archs:
            if arch in table:
                module, name = table[arch]
                return getattr(importlib.import_module(module), name)
    if runner != "pooling" and any(a in _POOLING_MODELS for a in archs):
        raise ValueError(f"{archs[0]} is a pooling model (embeddings, classification, "
                         "scores): it cannot generate text; use runner='pooling'")
    supported = supported_architectures() + (
        supported_pooling_architectures() if runner == "pooling" else [])
    raise ValueError(
        f"unsupported model architecture {archs or getattr(hf_config, 'model_type', None)!r}; "
        f"supported: {', '.join(supported)}"
    )


def _transformers_backend(hf_config: Any, runner: str, model_impl: str) -> type:
    """The backend's class, once its checks on the config pass (ValueError naming why not);
    under runner="pooling" build_model makes it an embedder (as_pooling_model)."""
    from shoal.models.transformers_backend.support import encoder_class_path, unsupported_reason

    reason = unsupported_reason(hf_config, runner)
    if reason is not None:
        archs = _architectures(hf_config) or [getattr(hf_config, "model_type", None)]
        if model_impl == "auto":
            raise ValueError(f"unsupported model architecture {archs[0]!r}: shoal has no class "
                             f"of its own for it (supported: {', '.join(supported_architectures())})"
                             f" and the Transformers backend cannot run it: {reason}")
        raise ValueError(f"the Transformers backend cannot run {archs[0]}: {reason}")
    module, name = encoder_class_path(hf_config) or TRANSFORMERS_BACKEND  # (encoders: pooling)
    return getattr(importlib.import_module(module), name)
