"""Gives a built engine core its KV connector (kv_transfer_config): the scheduler's admission
asks it for other engines' KV and hands it the prompts to save (shoal/kv_transfer).

Models whose KV cache groups are attention groups transfer (full attention, MLA, sliding
windows beside them, of one or several lengths: each layer's rows follow its group's table),
also beside linear-attention groups (hybrids: their recurrent states move at a block end,
which a producer keeps only with prefix caching on), and DeepSeek-V4's: its window rows and
its compressors' inputs of the open groups as sliding rows, its compressed entries (with
CSA's indexer keys) by entry index (kv_transfer/entries.py). A kind not known to move is
refused here."""

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

# Groups whose layers keep one or two rows per token (keys and values, MLA's latent rows,
# indexer keys, DeepSeek-V4's shared K=V window rows and its compressors' inputs of the open
# groups): their rows move as they are (a sliding group's: those its window reads at the
# prompt's end). Linear-attention groups move their states (kv_transfer/states.py),
# DeepSeek-V4's compressed entries their entries (kv_transfer/entries.py).
_TRANSFERABLE = (FullAttentionSpec, SlidingWindowSpec, LatentAttentionSpec, IndexerKeySpec,
                 LinearStateSpec, SlidingSharedKVSpec, CompressorStateSpec, CompressedEntrySpec)
_REFUSED = {  # kinds no model declares now (the first version of DeepSeek-V4's compressors)
    CompressorInputSpec: "DeepSeek-V4's per-token compressor inputs (CompressorInputSpec)",
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
                         "linear-attention states and DeepSeek-V4's windows, compressed "
                         "entries and open compressor groups)")


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
    ratios = tuple(s.ratio if isinstance(s, CompressedEntrySpec) else 0 for s in specs)

    def row(kv: Any, spec: Any) -> tuple[int, int, int]:
        if isinstance(spec, LinearStateSpec):
            return 1, 1, spec.state_bytes
        if isinstance(spec, CompressedEntrySpec):  # an entry, not the page's token slot
            return 1, 1, spec.head_size * spec.dtype_bytes
        return kv.shape[0], kv.shape[2], kv.shape[3] * kv.element_size()

    return KVRows(str(caches[0].dtype).removeprefix("torch."),
                  [row(kv, spec) for kv, spec in zip(caches, specs)],
                  tuple(window.get(i) for i in range(len(caches))), states,
                  ratios if any(ratios) else ())


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
    spec = core.config.speculative_config
    info = EngineInfo(scheduler.block_size, parallel.tensor_parallel_size, model,
                      parallel.pipeline_parallel_size,
                      pin_memory=on_cuda and parallel.world_size == 1,
                      kv_rows=_kv_rows(core),
                      # mp ranks share this host: fetched KV goes to them through /dev/shm
                      ranks_share_memory=(parallel.world_size > 1 and
                                          parallel.distributed_executor_backend == "mp"),
                      linear_states=linear_states,
                      drafter_kv=spec is not None and spec.drafts_with_kv)
    connector = build_connector(config, info)
    core.kv_connector = scheduler.connector = scheduler.admission.connector = connector
    server = getattr(connector, "server", None)
    logger.info("KV connector %s as %s%s", config.kv_connector, config.kv_role,
                f", serving KV on {config.kv_ip}:{server.port}" if server else "")
    return connector
