"""The KV events engine argument (vLLM's `kv_events_config`), kept beside EngineArgs, which
inherits it, and its parsed form."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.json_arg import json_object

PUBLISHERS = ("zmq", "null")


@dataclass(frozen=True)
class KVEventsConfig:
    """What the engine publishes its prefix-cache changes on (engine/kv_events.py)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # "null": events are collected and dropped (tests, overhead)
    endpoint: str = "tcp://*:5557"  # the PUB socket: [topic, seq (8 bytes BE), msgpack batch]
    replay_endpoint: str | None = None  # ROUTER socket answering "every batch since seq N"
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark (messages)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @classmethod
    def from_dict(cls, value: Any) -> KVEventsConfig:
        """ValueError naming the field on a bad key or value."""
        value = json_object(value, "kv_events_config")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_events_config: unknown field {unknown[0]!r} (known: "
                             f"{', '.join(sorted(known))})")
        cfg = cls(**value)
        cfg._check()
        return cfg

    def _check(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be a bool (got "
                             f"{self.enable_kv_cache_events!r})")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config.publisher must be one of {PUBLISHERS} (got "
                             f"{self.publisher!r})")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv_events_config.{name} must be a string (got "
                                 f"{getattr(self, name)!r})")
        if not self.endpoint:
            raise ValueError("kv_events_config.endpoint must not be empty")
        if self.replay_endpoint is not None and (not isinstance(self.replay_endpoint, str)
                                                 or not self.replay_endpoint):
            raise ValueError("kv_events_config.replay_endpoint must be a non-empty string "
                             f"or null (got {self.replay_endpoint!r})")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"kv_events_config.{name} must be an integer >= 1 (got {v!r})")


@dataclass
class KVEventsArgs:
    kv_events_config: dict[str, Any] | None = field(default=None, metadata={"help": (
        'publish prefix-cache events over ZMQ, as JSON: {"enable_kv_cache_events": true, '
        '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", '
        '"buffer_steps": 10000, "topic": ""} (a data-parallel replica adds its rank to the '
        "ports)")})

    def kv_events_settings(self) -> KVEventsConfig | None:
        """The parsed config, None when events are off; ValueError naming the bad field."""
        if self.kv_events_config is None:
            return None
        cfg = KVEventsConfig.from_dict(self.kv_events_config)
        return cfg if cfg.enable_kv_cache_events else None
