"""Which models the Transformers backend can run, decided from the config alone (before
anything is built); what only a pass through the model shows (soft-capping, head sizes,
layers without attention, bidirectional attention) is checked by the probes in model.py and
encoder.py.

Decoders run as transformers' causal LM (model.py); encoder-only models (is_encoder_only:
BERT-like families, bidirectional attention) as its base model or sequence classifier under
the pooling runner (encoder.py): packed prompts where the modeling code takes a custom
attention function, transformers' own forward over padded batches where it does not (MPNet,
DeBERTa, ...: encoder_padded.py)."""

from __future__ import annotations

import inspect
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


def unsupported_reason(hf_config: Any, runner: str = "generate") -> str | None:
    """Why the backend cannot run the model under `runner`, or None when the config shows no
    reason."""
    if getattr(hf_config, "is_encoder_decoder", False):
        return ("it is an encoder-decoder model (the backend runs decoder-only and "
                "encoder-only models)")
    if is_encoder_only(hf_config):
        return encoder_unsupported_reason(hf_config, runner)
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


def check_supported(hf_config: Any, runner: str = "generate") -> None:
    reason = unsupported_reason(hf_config, runner)
    if reason is not None:
        raise ValueError(f"the Transformers backend cannot run "
                         f"{_name(hf_config)}: {reason}")


def _name(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    return archs[0] if archs else repr(getattr(hf_config, "model_type", None))


# Checkpoint classes of an encoder whose head gives one result per token or per span, which
# the pooling runner has no task for (the backend builds encoders' embeddings and sequence
# classifiers).
_PER_TOKEN_HEADS = ("ForTokenClassification", "ForQuestionAnswering", "ForMultipleChoice")
_CAUSAL_CLASSES = ("ForCausalLM", "LMHeadModel")


def is_encoder_only(hf_config: Any) -> bool:
    """An encoder-only model (bidirectional attention): a model type with a masked-LM class
    (BERT and its descendants: DistilBERT, ELECTRA, XLM-R, ModernBERT...) whose config is not
    a decoder's. Decided without importing any modeling code; the probe in encoder.py checks
    that its attention really is bidirectional."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    if getattr(hf_config, "is_encoder_decoder", False) or getattr(hf_config, "is_decoder", False):
        return False
    archs = getattr(hf_config, "architectures", None) or []
    if archs and archs[0].endswith(_CAUSAL_CLASSES):
        return False
    return getattr(hf_config, "model_type", None) in MODEL_FOR_MASKED_LM_MAPPING_NAMES


def is_sequence_classifier(hf_config: Any) -> bool:
    """The checkpoint class has a sequence-classification head."""
    archs = getattr(hf_config, "architectures", None) or []
    return bool(archs) and archs[0].endswith("ForSequenceClassification")


def encoder_checkpoint_class(hf_config: Any) -> type:
    """transformers' class of an encoder's checkpoint (architectures[0]), else its base model
    class (a config without architectures, or naming a class of another model type)."""
    import transformers

    archs = getattr(hf_config, "architectures", None) or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if isinstance(cls, type) and getattr(cls, "config_class", None) is type(hf_config):
        return cls
    return _base_model_class(hf_config)


def _base_model_class(hf_config: Any) -> type:
    """transformers' base model class for the config (the first where a model type has
    several: Funnel's full model before its encoder-only one)."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    cls = MODEL_MAPPING[type(hf_config)]
    return cls[0] if isinstance(cls, tuple) else cls


def encoder_unsupported_reason(hf_config: Any, runner: str) -> str | None:
    """Why the backend cannot run an encoder-only model under `runner`, or None."""
    if runner != "pooling":
        return ("it is an encoder-only model (bidirectional attention): it cannot generate "
                "text; use runner='pooling' (embeddings, or classification with a "
                "...ForSequenceClassification checkpoint)")
    archs = getattr(hf_config, "architectures", None) or []
    heads = [a for a in archs[:1] if a.endswith(_PER_TOKEN_HEADS)]
    if heads:
        return (f"its checkpoint class {heads[0]} has a per-token or span head, which the "
                "backend does not build for encoders (it builds embeddings and sequence "
                "classifiers)")
    try:
        cls = encoder_checkpoint_class(hf_config)
    except KeyError:
        return (f"transformers has no model class for model_type "
                f"{getattr(hf_config, 'model_type', None)!r}")
    if packs_prompts(cls):
        return None
    # transformers' own forward over padded batches (encoder_padded.py) feeds it token ids
    base = _base_model_class(hf_config)
    if "input_ids" not in inspect.signature(base.forward).parameters:
        return (f"its modeling code ({cls.__name__}) does not support custom attention "
                f"functions, and its base model {base.__name__} takes no input_ids (it reads "
                "other inputs), so it cannot run over padded token batches either")
    return None


def packs_prompts(cls: type) -> bool:
    """Whether an encoder's checkpoint class takes a custom attention function, so the
    backend runs a step's prompts packed (encoder.py); otherwise transformers' own forward
    runs over padded batches (encoder_padded.py)."""
    return bool(getattr(cls, "_supports_attention_backend", False))


def encoder_class_path(hf_config: Any) -> tuple[str, str] | None:
    """(module, class) of the backend's encoder class for the config; None for a decoder."""
    if not is_encoder_only(hf_config):
        return None
    name = ("TransformersEncoderForSequenceClassification" if is_sequence_classifier(hf_config)
            else "TransformersEncoderModel")
    return "shoal.models.transformers_backend.encoder", name
