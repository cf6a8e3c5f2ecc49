"""The names the server answers to, /v1/models and /v1/models/{id}."""

from __future__ import annotations

from shoal.entrypoints.openai.errors import OpenAIError
from shoal.entrypoints.openai.responses import ModelCard, ModelList


class ServedModels:
    def __init__(self, names: list[str], root: str | None, max_model_len: int):
        if not names:
            raise ValueError("at least one served model name is needed")
        self.names = list(names)
        self.root = root
        self.max_model_len = max_model_len

    @property
    def default(self) -> str:
        return self.names[0]

    def check(self, model: str | None) -> str:
        """The name to report for a request's `model` (missing means the default)."""
        if model is None or model == "":
            return self.default
        if model not in self.names:
            raise OpenAIError(404, f"The model `{model}` does not exist.", "model")
        return model

    def card(self, name: str) -> ModelCard:
        if name not in self.names:
            raise OpenAIError(404, f"The model `{name}` does not exist.", "model")
        return ModelCard(id=name, root=self.root or self.default,
                         max_model_len=self.max_model_len)

    def list(self) -> ModelList:
        return ModelList(data=[self.card(n) for n in self.names])
