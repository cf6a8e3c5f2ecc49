"""One rank's runner: how every executor (uni, mp, Ray) builds its ranks, and how a worker
rank loads the model the driver loaded."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.config import EngineConfig
from shoal.loader import LoadedModel

if TYPE_CHECKING:
    from shoal.worker.model_runner import ModelRunner
    from shoal.worker.pooling_runner import PoolingModelRunner


def model_runner(config: EngineConfig, loaded: LoadedModel) -> ModelRunner | PoolingModelRunner:
    """A ModelRunner with the speculative config's drafter; the PoolingModelRunner for a
    pooling model (runner="pooling"), on every rank alike."""
    if config.model_config.runner == "pooling":
        from shoal.worker.pooling_runner import PoolingModelRunner

        return PoolingModelRunner(config, loaded)
    from shoal.spec_decode.factory import build_drafter
    from shoal.worker.model_runner import ModelRunner

    return ModelRunner(config, loaded, build_drafter)


def load_rank_model(config: EngineConfig) -> LoadedModel:
    """A worker rank's load of the engine's model: the driver's settings, and the config
    fields --hf-overrides set on the driver's (the overrides pick the class and shape the
    layers, so a rank without them builds another model)."""
    from shoal.loader import load_model

    mc = config.model_config
    loaded = load_model(mc.model, tokenizer=mc.tokenizer, load_format=mc.load_format,
                        quantization=mc.quantization, language_model_only=mc.language_model_only)
    for key, value in mc.hf_overrides.items():
        setattr(loaded.hf_config, key, value)
    return loaded
