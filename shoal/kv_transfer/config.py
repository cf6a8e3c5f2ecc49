"""kv_transfer_config (vLLM's engine argument): which connector, in which role."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("kv_producer", "kv_consumer", "kv_both")
_KEYS = ("kv_connector", "kv_role", "kv_ip", "kv_port", "kv_connector_extra_config",
         "kv_connector_module_path", "engine_id")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str  # a name in factory.CONNECTORS, or "module:Class"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"  # where a producer serves its KV
    kv_port: int = 14579  # (0: any free port)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def from_user(cls, value: Any) -> KVTransferConfig | None:
        """From the engine argument (a dict, or None: no connector); ValueError naming the
        field that is wrong."""
        if value is None:
            return None
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object (got {value!r})")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key(s) {', '.join(unknown)}; known: "
                             f"{', '.join(_KEYS)}")
        name = value.get("kv_connector")
        if not isinstance(name, str) or not name:
            raise ValueError("kv_transfer_config.kv_connector must name a connector (e.g. "
                             "'P2PConnector') or 'module:Class'")
        role = value.get("kv_role", "kv_both")
        if role not in ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {', '.join(ROLES)} "
                             f"(got {role!r})")
        port = value.get("kv_port", 14579)
        if type(port) is not int or not 0 <= port < 65536:
            raise ValueError(f"kv_transfer_config.kv_port must be an integer in [0, 65536) "
                             f"(got {port!r})")
        extra = value.get("kv_connector_extra_config") or {}
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be an object")
        ip = value.get("kv_ip", "127.0.0.1")
        if not isinstance(ip, str) or not ip:
            raise ValueError(f"kv_transfer_config.kv_ip must be a host name (got {ip!r})")
        return cls(name, role, ip, port, dict(extra))
