"""shoal: a paged-KV LLM inference and serving engine.

Importing the package loads nothing heavy: `LLM` and friends are imported on first use, so
light modules (sampling_params, kv_cache.hashing, the server's protocol) import without torch
or transformers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "PoolingParams", "RequestOutput",
           "CompletionOutput", "TextPrompt", "TokensPrompt"]

_LAZY = {
    "LLM": "shoal.llm",
    "SamplingParams": "shoal.sampling_params",
    "BeamSearchParams": "shoal.sampling_params",
    "PoolingParams": "shoal.pooling_params",
    "TextPrompt": "shoal.inputs",
    "TokensPrompt": "shoal.inputs",
    "RequestOutput": "shoal.outputs",
    "CompletionOutput": "shoal.outputs",
}

if TYPE_CHECKING:
    from shoal.inputs import TextPrompt, TokensPrompt
    from shoal.llm import LLM
    from shoal.outputs import CompletionOutput, RequestOutput
    from shoal.pooling_params import PoolingParams
    from shoal.sampling_params import BeamSearchParams, SamplingParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shoal' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
