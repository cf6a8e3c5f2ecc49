"""The names the server answers to, /v1/models and /v1/models/{id}: the base model's names
and the LoRA adapters (--lora-modules, and /v1/load_lora_adapter at run time), each adapter
a model of its own whose `parent` is the base."""

from __future__ import annotations

import itertools
from typing import Any

from shoal.entrypoints.openai.errors import OpenAIError
from shoal.entrypoints.openai.responses import ModelCard, ModelList
from shoal.lora.adapter import LoRALimits, check_adapter
from shoal.lora_request import LoRARequest


class ServedModels:
    def __init__(self, names: list[str], root: str | None, max_model_len: int,
                 lora_limits: LoRALimits | None = None):
        if not names:
            raise ValueError("at least one served model name is needed")
        self.names = list(names)
        self.root = root
        self.max_model_len = max_model_len
        self.lora_limits = lora_limits
        self.loras: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)  # never reused: an id names one folder for good

    @property
    def default(self) -> str:
        return self.names[0]

    def check(self, model: str | None) -> str:
        """The name to report for a request's `model` (missing means the default)."""
        if model is None or model == "":
            return self.default
        if model not in self.names and model not in self.loras:
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model")
        return model

    def lora(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model)."""
        return self.loras.get(model) if model else None

    def card(self, name: str) -> ModelCard:
        lora = self.loras.get(name)
        if lora is not None:
            return ModelCard(id=name, root=lora.lora_path,
                             parent=lora.base_model_name or self.default,
                             max_model_len=self.max_model_len)
        if name not in self.names:
            raise OpenAIError(404, f"The model `{name}` does not exist.", "model")
        return ModelCard(id=name, root=self.root or self.default,
                         max_model_len=self.max_model_len)

    def list(self) -> ModelList:
        return ModelList(data=[self.card(n) for n in (*self.names, *self.loras)])

    # ---- adapters -----------------------------------------------------------------------------
    def load_lora(self, name: Any, path: Any, base_model_name: str | None = None
                  ) -> LoRARequest:
        """Checks the adapter against the engine (files, rank, shapes) and serves it as
        `name`; OpenAIError 400 naming what is wrong."""
        if not isinstance(name, str) or not name:
            raise OpenAIError(400, "lora_name must be a non-empty string", "lora_name")
        if not isinstance(path, str) or not path:
            raise OpenAIError(400, "lora_path must be a non-empty string", "lora_path")
        if self.lora_limits is None:
            raise OpenAIError(400, "this server serves no LoRA adapters (start it with "
                                   "--enable-lora)", "lora_name")
        if name in self.loras:
            raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.",
                              "lora_name")
        if name in self.names:
            raise OpenAIError(400, f"'{name}' is the base model's name", "lora_name")
        try:
            check_adapter(path, self.lora_limits)
        except ValueError as e:
            raise OpenAIError(400, str(e), "lora_path") from None
        lora = LoRARequest(name, next(self._lora_ids), path, base_model_name)
        self.loras[name] = lora
        return lora

    def unload_lora(self, name: Any) -> LoRARequest:
        if not isinstance(name, str) or not name:
            raise OpenAIError(400, "lora_name must be a non-empty string", "lora_name")
        lora = self.loras.pop(name, None)
        if lora is None:
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        return lora
