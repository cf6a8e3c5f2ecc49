"""A connector by name (CONNECTORS) or `module:Class` (a KVConnector subclass)."""

from __future__ import annotations

import importlib

from shoal.kv_transfer.base import EngineInfo, KVConnector
from shoal.kv_transfer.config import KVTransferConfig

CONNECTORS = {"P2PConnector": ("shoal.kv_transfer.p2p", "P2PConnector")}


def build_connector(config: KVTransferConfig, engine: EngineInfo) -> KVConnector:
    name = config.kv_connector
    if name in CONNECTORS:
        module, cls_name = CONNECTORS[name]
    elif ":" in name:
        module, cls_name = name.split(":", 1)
    else:
        raise ValueError(f"kv_transfer_config.kv_connector: unknown connector {name!r}; "
                         f"known: {', '.join(CONNECTORS)}, or 'module:Class'")
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"kv_transfer_config.kv_connector {name!r} cannot be loaded: {e}"
                         ) from e
    if not (isinstance(cls, type) and issubclass(cls, KVConnector)):
        raise ValueError(f"kv_transfer_config.kv_connector {name!r} is not a KVConnector")
    if engine.pipeline_parallel_size > 1:  # (each stage holds only some of the layers)
        raise ValueError("kv_transfer_config with pipeline_parallel_size > 1 is not "
                         "supported yet")
    return cls(config, engine)
