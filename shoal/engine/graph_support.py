"""Which models run without CUDA graphs whatever enforce_eager says: the ones the engine
cannot capture, run eagerly rather than refused (as vLLM falls back to eager mode for models
without graph support)."""

from __future__ import annotations

import logging
from typing import Any

from shoal.models.registry import resolve_model_class, takes_transformers_backend

logger = logging.getLogger(__name__)


def runs_without_graphs(hf_config: Any, runner: str, model_impl: str, device_type: str) -> bool:
    """On CUDA, a shoal class whose `eager_only_reason` says why its forward cannot be
    captured, said in one log line (one whose `decode_graphs_only` says why only its decode
    steps are captured keeps graphs, said too). Not the Transformers backend (whose checks on
    the config raise here, before the compatibility table): whether transformers' code
    captures is found out on the captured graphs at start-up (shoal/worker/graph_check.py)."""
    if takes_transformers_backend(hf_config, runner, model_impl):
        return False
    if device_type != "cuda":
        return False
    try:
        cls = resolve_model_class(hf_config, runner, model_impl)
    except ValueError:  # (an unknown architecture fails where the model is built)
        return False
    reason = getattr(cls, "eager_only_reason", None)
    only_decodes = getattr(cls, "decode_graphs_only", None)
    if only_decodes and not reason:  # (the runner captures decode shapes only)
        logger.info("%s: CUDA graphs of decode steps only: %s", cls.__name__, only_decodes)
    if reason:
        logger.info("%s runs without CUDA graphs (enforce_eager): %s", cls.__name__, reason)
    return bool(reason)
