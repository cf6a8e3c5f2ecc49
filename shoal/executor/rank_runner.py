"""One rank's runner: how every executor (uni, mp, Ray) builds its ranks."""

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
