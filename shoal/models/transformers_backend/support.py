"""Which models the Transformers backend can run, decided from the config alone (before
anything is built); what only a pass through the model shows (soft-capping, head sizes,
layers without attention) is checked by the probe in model.py."""

from __future__ import annotations

from typing import Any

# Layer kinds whose cache is shoal's paged K/V (full, or a sliding window).
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})


def causal_lm_class(hf_config: Any) -> type:
    """transformers' causal-LM class for the config (AutoModelForCausalLM's choice)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except KeyError:
        pass
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    model_type = getattr(hf_config, "model_type", None)
    if type(hf_config) in MODEL_MAPPING:  # a base model only: an encoder
        raise ValueError(f"transformers has no causal-LM class for model_type {model_type!r}: "
                         "it is an encoder-only model, whose bidirectional attention the "
                         "backend's causal paged attention does not run (its embeddings "
                         "need a class of shoal's own)")
    raise ValueError(f"transformers has no causal-LM class for model_type {model_type!r}")


# Checkpoint classes with a task head on top of the decoder, which the backend does not build
# (it runs the causal LM: generation, or its hidden states as embeddings).
_TASK_HEADS = ("ForSequenceClassification", "ForTokenClassification", "ForQuestionAnswering")


def unsupported_reason(hf_config: Any) -> str | None:
    """Why the backend cannot run the model, or None when the config shows no reason."""
    if getattr(hf_config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model (the backend runs decoder-only models)"
    heads = [a for a in getattr(hf_config, "architectures", None) or []
             if a.endswith(_TASK_HEADS)]
    if heads:
        return (f"its checkpoint class {heads[0]} has a task head, which the backend does "
                "not build (it runs the causal LM: generation, or embeddings from its hidden "
                "states under runner='pooling')")
    try:
        cls = causal_lm_class(hf_config)
    except ValueError as e:
        return str(e)
    if not getattr(cls, "_supports_attention_backend", False):
        return (f"its modeling code ({cls.__name__}) does not support custom attention "
                "functions (_supports_attention_backend is False), so shoal's paged attention "
                "cannot be plugged in")
    if getattr(hf_config, "kv_lora_rank", None) is not None:
        return ("it has multi-head latent attention (MLA, kv_lora_rank), whose latent cache "
                "only shoal's own classes keep")
    kinds = sorted(set(getattr(hf_config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES)
    if kinds:
        return (f"it has layers of kind {', '.join(map(repr, kinds))}, whose cache (recurrent "
                "state, convolution windows, attention chunks) shoal's paged K/V layers do "
                "not keep")
    return None


def check_supported(hf_config: Any) -> None:
    reason = unsupported_reason(hf_config)
    if reason is not None:
        raise ValueError(f"the Transformers backend cannot run "
                         f"{_name(hf_config)}: {reason}")


def _name(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    return archs[0] if archs else repr(getattr(hf_config, "model_type", None))
