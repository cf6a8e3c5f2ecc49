"""One rank's generation runner: how every executor (uni, mp, Ray) builds its ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.config import EngineConfig
from shoal.loader import LoadedModel

if TYPE_CHECKING:
    from shoal.worker.model_runner import ModelRunner


def model_runner(config: EngineConfig, loaded: LoadedModel) -> ModelRunner:
    """A ModelRunner with the speculative config's drafter."""
    from shoal.spec_decode.factory import build_drafter
    from shoal.worker.model_runner import ModelRunner

    return ModelRunner(config, loaded, build_drafter)
