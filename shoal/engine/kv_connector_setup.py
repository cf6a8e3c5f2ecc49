"""Gives a built engine core its KV connector (kv_transfer_config): the scheduler's admission
asks it for other engines' KV and hands it the prompts to save (shoal/kv_transfer).

Models whose KV cache groups are attention groups transfer (full attention, MLA, sliding
windows beside them, of one or several lengths: each layer's rows follow its group's table),
also beside linear-attention groups (hybrids: their recurrent states move at a block end,
which a producer keeps only with prefix caching on); DeepSeek-V4's groups, which keep
something else per token, are refused here by kind."""

from __future__ import annotations

import logging
from typing import Any

from shoal.core.kv_cache_spec import (
    CompressedEntrySpec,
    CompressorInputSpec,
    CompressorStateSpec,
    FullAttentionSpec,
    IndexerKeySpec,
    KVCacheGroup,
    LatentAttentionSpec,
    LinearStateSpec,
    SlidingSharedKVSpec,
    SlidingWindowSpec,
)
from shoal.kv_transfer.base import EngineInfo, KVConnector, KVRows
from shoal.kv_transfer.config import KVTransferConfig
from shoal.kv_transfer.factory import build_connector

logger = logging.getLogger(__name__)

# Groups whose layers keep keys and values (or MLA's latent rows) per token: their rows move
# as they are (a sliding group's: those its window reads at the prompt's end).
# Linear-attention groups move their states (kv_transfer/states.py).
_TRANSFERABLE = (FullAttentionSpec, SlidingWindowSpec, LatentAttentionSpec, IndexerKeySpec,
                 LinearStateSpec)
_REFUSED = {  # (the most specific class first: several derive from the transferable ones)
    SlidingSharedKVSpec: "DeepSeek-V4's shared-KV windows (SlidingSharedKVSpec)",
    CompressorStateSpec: "DeepSeek-V4's compressor states (CompressorStateSpec)",
    CompressedEntrySpec: "DeepSeek-V4's compressed entries (CompressedEntrySpec)",
    CompressorInputSpec: "DeepSeek-V4's compressor inputs (CompressorInputSpec)",
}


def check_groups(groups: list[KVCacheGroup]) -> None:
    """ValueError naming the first KV cache group whose kind cannot be transferred."""
    for i, g in enumerate(groups):
        spec = g.spec
        if type(spec) in _TRANSFERABLE:
            continue
        kind = next((name for cls, name in _REFUSED.items() if isinstance(spec, cls)),
                    type(spec).__name__)
        raise ValueError(f"kv_transfer_config: KV cache group {i} of {len(groups)} holds "
                         f"{kind}, which prefill/decode disaggregation does not transfer "
                         "yet (only attention groups: full attention, MLA, sliding windows, "
                         "and linear-attention states)")


def _kv_rows(core: Any) -> KVRows | None:
    """What rank 0's paged caches hold (to refuse another model's KV before it is loaded);
    None where the runner is not in this process."""
    runner = getattr(core.runner, "driver", core.runner)
    model = getattr(runner, "model", None)
    caches = [getattr(layer, "kv_cache", None) for layer in model.attention_layers()] \
        if model is not None else []
    if not caches or any(kv is None or kv.dim() != 4 for kv in caches):
        return None
    window = {i: g.sliding_window for t in core.scheduler.kv.tables for g in (t.group,)
              for i in g.layers}
    specs = getattr(runner, "kv_specs", None) or [None] * len(caches)
    states = tuple(i for i, s in enumerate(specs) if isinstance(s, LinearStateSpec))
    return KVRows(str(caches[0].dtype).removeprefix("torch."),
                  [(1, 1, spec.state_bytes) if isinstance(spec, LinearStateSpec) else
                   (kv.shape[0], kv.shape[2], kv.shape[3] * kv.element_size())
                   for kv, spec in zip(caches, specs)],
                  tuple(window.get(i) for i in range(len(caches))), states)


def attach_kv_connector(core: Any, config: KVTransferConfig | None, model: str
                        ) -> KVConnector | None:
    if config is None:
        return None
    scheduler = core.scheduler
    if not hasattr(scheduler, "admission"):
        raise ValueError("kv_transfer_config: the pooling runner keeps no KV cache to transfer")
    groups = [t.group for t in scheduler.kv.tables]
    check_groups(groups)
    linear_states = any(g.holds_state for g in groups)
    if linear_states and config.produces and not scheduler.kv.enable_caching:
        raise ValueError("kv_transfer_config: a producer (kv_producer / kv_both) of a model "
                         "with linear-attention layers needs enable_prefix_caching (its "
                         "layers keep their states at block ends, which are sent, only then)")
    parallel = core.config.parallel_config
    on_cuda = core.config.device.type == "cuda"
    info = EngineInfo(scheduler.block_size, parallel.tensor_parallel_size, model,
                      parallel.pipeline_parallel_size,
                      pin_memory=on_cuda and parallel.world_size == 1,
                      kv_rows=_kv_rows(core),
                      # mp ranks share this host: fetched KV goes to them through /dev/shm
                      ranks_share_memory=(parallel.world_size > 1 and
                                          parallel.distributed_executor_backend == "mp"),
                      linear_states=linear_states)
    connector = build_connector(config, info)
    core.kv_connector = scheduler.connector = scheduler.admission.connector = connector
    server = getattr(connector, "server", None)
    logger.info("KV connector %s as %s%s", config.kv_connector, config.kv_role,
                f", serving KV on {config.kv_ip}:{server.port}" if server else "")
    return connector
