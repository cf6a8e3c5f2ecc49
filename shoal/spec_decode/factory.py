"""The drafter a speculative config asks for (None: no speculation). The executor hands this
factory to the model runner, which calls it once its target model is built: "mtp" and
"eagle" heads share the target's embedding and LM head.

Pipeline parallelism: only stage 0 drafts. It holds the embedding and the LM head, receives
the last stage's final hidden states and samples (shoal/worker/stage_link.py), so it has
everything a drafter reads; the later stages run the verify steps' tokens like any others
and build no drafter (None)."""

from __future__ import annotations

from typing import Any

from shoal.config import EngineConfig
from shoal.config.speculative import FORCED
from shoal.distributed.parallel_state import pp_is_first
from shoal.worker.drafter import Drafter


def build_drafter(engine_config: EngineConfig, target: Any, loaded: Any) -> Drafter | None:
    config = engine_config.speculative_config
    if config is None or not pp_is_first():
        return None
    if config.method == "ngram":
        from shoal.spec_decode.ngram import NgramDrafter

        return NgramDrafter(config)
    if config.method == FORCED:
        from shoal.spec_decode.forced import ForcedAcceptance

        return ForcedAcceptance(config)
    if config.method == "draft_model":
        from shoal.spec_decode.draft_model import DraftModelDrafter

        return DraftModelDrafter(engine_config, config)
    if config.method == "eagle3":
        from shoal.spec_decode.eagle3 import Eagle3Drafter

        return Eagle3Drafter(engine_config, config, target, loaded)
    if config.method in ("mtp", "eagle"):
        from shoal.spec_decode.mtp import HiddenStateDrafter, build_mtp_head

        if config.method == "mtp":
            head = build_mtp_head(engine_config, target, loaded)
        else:
            from shoal.spec_decode.eagle_head import build_eagle_head

            head = build_eagle_head(engine_config, config, target, loaded)
        return HiddenStateDrafter(engine_config, config, head)
    raise ValueError(f"speculative_config: method {config.method!r} is not supported yet")
