"""A request's LoRA adapter, as vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`.

A msgspec struct: it travels inside EngineCoreRequest to the engine process and on to the
worker ranks, which load the adapter from `lora_path` themselves."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True):
    lora_name: str
    lora_int_id: int  # >= 1, unique per adapter for the engine's lifetime
    lora_path: str = ""  # a PEFT folder: adapter_config.json + adapter_model.safetensors
    base_model_name: str | None = None  # the served model it extends (the server's parent)
    # The SHA-256 of the folder's files (shoal/lora/adapter_digest.py), set by the engine core
    # when the request arrives, whatever a caller set: the prefix cache keys the request's
    # blocks by it, and the worker ranks check what they read against it.
    content_digest: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if (not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool)
                or self.lora_int_id < 1):
            raise ValueError(f"lora_int_id must be an integer >= 1 (got {self.lora_int_id!r})")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must name the adapter's folder")
        if self.content_digest is not None and not isinstance(self.content_digest, str):
            raise ValueError(f"content_digest must be a string or None (got "
                             f"{self.content_digest!r})")

    # vLLM's shorter names
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def cache_key(self) -> str:
        """What the prefix-cache hashes mix in: two adapters never share a KV block, and
        neither do one adapter's id reused for another folder nor one folder saved again
        with other weights."""
        return f"lora:{self.lora_int_id}:{self.lora_path}:{self.content_digest or ''}"
