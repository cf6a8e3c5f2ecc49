"""Model resolution and loading: GGUF files, transformers folders, and dummy (random) weights.

The names below are imported on first use: resolving a model name or reading a tokenizer (the
server's frontend) must not load torch and the weight loaders."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "DEFAULT_MODEL_NAME": "shoal.loader.resolve",
    "ModelNotFoundError": "shoal.loader.resolve",
    "ModelSource": "shoal.loader.resolve",
    "known_model_names": "shoal.loader.resolve",
    "resolve_model": "shoal.loader.resolve",
    "load_frontend_tokenizer": "shoal.loader.tokenizers",
    "load_tokenizer": "shoal.loader.tokenizers",
    "LOAD_FORMATS": "shoal.loader.load",
    "load_model": "shoal.loader.load",
    "LoadedModel": "shoal.loader.loaded_model",
    "initialize_dummy_weights": "shoal.loader.dummy",
    "build_model": "shoal.loader.build",
}
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

if TYPE_CHECKING:
    from shoal.loader.build import build_model
    from shoal.loader.dummy import initialize_dummy_weights
    from shoal.loader.load import LOAD_FORMATS, load_model
    from shoal.loader.loaded_model import LoadedModel
    from shoal.loader.resolve import (
        DEFAULT_MODEL_NAME,
        ModelNotFoundError,
        ModelSource,
        known_model_names,
        resolve_model,
    )
    from shoal.loader.tokenizers import load_frontend_tokenizer, load_tokenizer


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shoal.loader' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
