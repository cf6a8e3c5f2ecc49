"""The drafter a speculative config asks for (None: no speculation). The executor hands this
factory to the model runner, which calls it once its target model is built: "mtp" and
"eagle" heads share the target's embedding and LM head.

Pipeline parallelism: only stage 0 drafts. It holds the embedding and the LM head, receives
the last stage's final hidden states and samples (shoal/worker/stage_link.py), so it has
everything a drafter reads; the later stages run the verify steps' tokens like any others
and build no drafter (None). EAGLE-3 reads aux hidden states of layers on every stage: each
later stage's target records those of its own layers, which travel to stage 0 with the
final hidden states. MTP heads live on stage 0 too: an MTP layer reads the final hidden
state and the embedding of the next token, and its logits come from the target's LM head
(DeepSeek-V3's when the checkpoint has no copy; Qwen3-Next's always), all of which stage 0
holds; it knows the sampled tokens the mirror reads first, and its per-request state (the
drafter KV cache, mtp_chain.py's carry) stays in one place as on one stage. On the last
stage it would need the sampled tokens sent there and the drafts back, and a copy of the
embedding and LM head. The price: stage 0 holds the MTP layers' weights and KV cache
(SHOAL_PP_LAYER_PARTITION can give it fewer decoder layers)."""

from __future__ import annotations

from typing import Any

from shoal.config import EngineConfig
from shoal.config.speculative import FORCED
from shoal.distributed.parallel_state import expert_parallel, pp_is_first
from shoal.layers import rotary_share
from shoal.layers.linear import triton_ops_while_building
from shoal.worker.drafter import Drafter


def build_drafter(engine_config: EngineConfig, target: Any, loaded: Any) -> Drafter | None:
    # A head's layers share the target's rotary tables. Under DP+EP a head's MoE layer (an
    # MTP layer) splits its experts over the replicas as the target's do (a draft model is
    # built so by build_model): DeepSeek-V3's MTP layer holds 256 experts, too many to keep
    # whole on every replica. Its passes then run in step with the other replicas'
    # (worker/draft_lockstep.py); TP+EP heads keep their experts as before.
    dp_ep = engine_config.parallel_config.dp_expert_parallel
    with rotary_share.one_model(target), expert_parallel(dp_ep), \
            triton_ops_while_building(engine_config.use_triton_ops):
        drafter = _build_drafter(engine_config, target, loaded)
    config = engine_config.speculative_config
    if config is not None and config.forced_acceptance_rate is not None:  # test-only
        from shoal.spec_decode.forced_overlay import overlay_forced_acceptance

        drafter = overlay_forced_acceptance(drafter, config)
    return drafter


def _build_drafter(engine_config: EngineConfig, target: Any, loaded: Any) -> Drafter | None:
    config = engine_config.speculative_config
    if config is None:
        return None
    if not pp_is_first():
        if config.method == "eagle3":
            from shoal.spec_decode.eagle3 import record_stage_aux

            record_stage_aux(engine_config, config, target, loaded)
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
        from shoal.spec_decode.mtp import HiddenStateDrafter
        from shoal.spec_decode.mtp_heads import build_mtp_head

        if config.method == "mtp":
            head = build_mtp_head(engine_config, target, loaded)
        else:
            from shoal.spec_decode.eagle_head import build_eagle_head

            head = build_eagle_head(engine_config, config, target, loaded)
        return HiddenStateDrafter(engine_config, config, head)
    raise ValueError(f"speculative_config: method {config.method!r} is not supported yet")
