"""Request bodies of the pooling endpoints (vLLM's shapes): /v1/embeddings, /pooling,
/classify, /score, /rerank (Cohere/Jina)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import StrictBool, StrictInt, StrictStr

from shoal.entrypoints.openai.protocol import OpenAIBaseModel, TokenIds

# str | list[str] | list[int] | list[list[int]], checked by normalize_inputs
PoolingInput = StrictStr | list[StrictStr] | TokenIds | list[TokenIds]

# Fields vLLM's pooling requests define that shoal refuses rather than ignores.
_UNSUPPORTED = {
    "messages": "chat-style embedding requests (messages) are not supported: send input",
    "mm_processor_kwargs": "multimodal inputs are not supported",
    "lora_request": "LoRA adapters are not supported yet",
    "embed_dtype": "embed_dtype is not supported: embeddings are float32",
    "chat_template": "chat templates are not used by the pooling endpoints",
}


class PoolingBaseRequest(OpenAIBaseModel):
    model: StrictStr | None = None
    user: StrictStr | None = None
    truncate_prompt_tokens: StrictInt | None = None
    add_special_tokens: StrictBool = True
    priority: StrictInt = 0
    request_id: StrictStr | None = None

    def unsupported(self) -> tuple[str, str] | None:
        for name in self.model_extra or {}:
            if name in _UNSUPPORTED and (self.model_extra or {})[name] is not None:
                return name, _UNSUPPORTED[name]
        return self.not_implemented()


class EmbeddingRequest(PoolingBaseRequest):
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    normalize: StrictBool | None = None


class PoolingRequest(EmbeddingRequest):
    task: Literal["embed", "token_embed", "classify", "token_classify"] | None = None


class ClassificationRequest(PoolingBaseRequest):
    input: PoolingInput
    use_activation: StrictBool | None = None


class ScoreRequest(PoolingBaseRequest):
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    use_activation: StrictBool | None = None


class RerankRequest(PoolingBaseRequest):
    query: StrictStr
    documents: list[StrictStr]
    top_n: StrictInt = 0  # 0: every document
    return_documents: StrictBool = True
    use_activation: StrictBool | None = None


def normalize_inputs(value: Any) -> list[str | list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> a non-empty list of inputs."""
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value:
        raise ValueError("input must not be empty")
    if all(isinstance(t, int) for t in value):
        return [list(value)]
    return list(value)
