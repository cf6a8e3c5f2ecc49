"""The KV connector engine argument (vLLM's `kv_transfer_config`), kept beside EngineArgs,
which inherits it; shoal/kv_transfer reads it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.json_arg import json_object


@dataclass
class KVTransferArgs:
    kv_transfer_config: dict[str, Any] | None = field(default=None, metadata={
        "help": 'prefill/decode disaggregation, as JSON: {"kv_connector": "P2PConnector", '
                '"kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_ip": ..., '
                '"kv_port": ...} (shoal/kv_transfer)'})

    def kv_transfer_settings(self) -> Any:
        """The parsed config (KVTransferConfig) or None; ValueError naming a bad field."""
        from shoal.kv_transfer.config import KVTransferConfig

        value = self.kv_transfer_config
        if value is not None:
            value = json_object(value, "kv_transfer_config")
        return KVTransferConfig.from_user(value)
