"""Gives a built engine core its KV connector (kv_transfer_config): the scheduler's admission
asks it for other engines' KV and hands it the prompts to save (shoal/kv_transfer)."""

from __future__ import annotations

import logging
from typing import Any

from shoal.kv_transfer.base import EngineInfo, KVConnector, KVRows
from shoal.kv_transfer.config import KVTransferConfig
from shoal.kv_transfer.factory import build_connector

logger = logging.getLogger(__name__)


def _kv_rows(core: Any) -> KVRows | None:
    """What rank 0's paged caches hold (to refuse another model's KV before it is loaded);
    None where the runner is not in this process."""
    runner = getattr(core.runner, "driver", core.runner)
    model = getattr(runner, "model", None)
    caches = [getattr(layer, "kv_cache", None) for layer in model.attention_layers()] \
        if model is not None else []
    if not caches or any(kv is None or kv.dim() != 4 for kv in caches):
        return None
    return KVRows(str(caches[0].dtype).removeprefix("torch."),
                  [(kv.shape[0], kv.shape[2], kv.shape[3] * kv.element_size())
                   for kv in caches])


def attach_kv_connector(core: Any, config: KVTransferConfig | None, model: str
                        ) -> KVConnector | None:
    if config is None:
        return None
    scheduler = core.scheduler
    if not hasattr(scheduler, "admission"):
        raise ValueError("kv_transfer_config: the pooling runner keeps no KV cache to transfer")
    if len(scheduler.kv.tables) > 1:
        raise ValueError("kv_transfer_config: models with several KV cache groups (sliding "
                         "windows beside full attention, linear attention) are not supported "
                         "yet")
    parallel = core.config.parallel_config
    on_cuda = core.config.device.type == "cuda"
    info = EngineInfo(scheduler.block_size, parallel.tensor_parallel_size, model,
                      parallel.pipeline_parallel_size,
                      pin_memory=on_cuda and parallel.world_size == 1,
                      kv_rows=_kv_rows(core),
                      # mp ranks share this host: fetched KV goes to them through /dev/shm
                      ranks_share_memory=(parallel.world_size > 1 and
                                          parallel.distributed_executor_backend == "mp"))
    connector = build_connector(config, info)
    core.kv_connector = scheduler.connector = scheduler.admission.connector = connector
    server = getattr(connector, "server", None)
    logger.info("KV connector %s as %s%s", config.kv_connector, config.kv_role,
                f", serving KV on {config.kv_ip}:{server.port}" if server else "")
    return connector
