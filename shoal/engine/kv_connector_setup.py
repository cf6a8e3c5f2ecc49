"""Gives a built engine core its KV connector (kv_transfer_config): the scheduler's admission
asks it for other engines' KV and hands it the prompts to save (shoal/kv_transfer)."""

from __future__ import annotations

import logging
from typing import Any

from shoal.kv_transfer.base import EngineInfo, KVConnector
from shoal.kv_transfer.config import KVTransferConfig
from shoal.kv_transfer.factory import build_connector

logger = logging.getLogger(__name__)


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
    info = EngineInfo(scheduler.block_size, parallel.tensor_parallel_size, model)
    connector = build_connector(config, info)
    core.kv_connector = scheduler.connector = scheduler.admission.connector = connector
    server = getattr(connector, "server", None)
    logger.info("KV connector %s as %s%s", config.kv_connector, config.kv_role,
                f", serving KV on {config.kv_ip}:{server.port}" if server else "")
    return connector
