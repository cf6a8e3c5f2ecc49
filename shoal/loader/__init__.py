"""Model resolution and loading: GGUF files, transformers folders, and dummy (random) weights."""

from shoal.loader.build import build_model
from shoal.loader.dummy import initialize_dummy_weights
from shoal.loader.load import LOAD_FORMATS, load_frontend_tokenizer, load_model, load_tokenizer
from shoal.loader.loaded_model import LoadedModel
from shoal.loader.resolve import (
    DEFAULT_MODEL_NAME,
    ModelNotFoundError,
    ModelSource,
    known_model_names,
    resolve_model,
)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "LOAD_FORMATS",
    "LoadedModel",
    "ModelNotFoundError",
    "ModelSource",
    "build_model",
    "initialize_dummy_weights",
    "known_model_names",
    "load_frontend_tokenizer",
    "load_model",
    "load_tokenizer",
    "resolve_model",
]
