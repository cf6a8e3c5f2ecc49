"""OpenAI response bodies (pydantic), shaped exactly as the API sends them."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int | None) -> Usage:
        """`cached` None leaves prompt_tokens_details out (vLLM sends it only with
        --enable-prompt-tokens-details)."""
        return cls(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion,
                   prompt_tokens_details=None if cached is None
                   else PromptTokensDetails(cached_tokens=cached))

    @staticmethod
    def dict_of(prompt: int, completion: int, cached: int | None) -> dict[str, Any]:
        """The same as Usage.of(...).model_dump(), without pydantic (streamed chunks)."""
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion,
                "prompt_tokens_details": None if cached is None else {"cached_tokens": cached}}


# ---- /v1/completions ---------------------------------------------------------------------
class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    # vLLM's return_token_ids; the keys are always sent (null unless asked), as vLLM does.
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    # vLLM's: a prefill engine's answer says where a decode engine fetches the KV
    kv_transfer_params: dict[str, Any] | None = None


# ---- /v1/chat/completions ----------------------------------------------------------------
class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"  # the last message's role when continue_final_message continues it
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict] = Field(default_factory=list)
    reasoning_content: str | None = None  # with --reasoning-parser


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    service_tier: str | None = None  # the key OpenAI's SDK expects (always null here)
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # (as CompletionResponse's)


class DeltaMessage(BaseModel):
    """Only the fields set are sent, as OpenAI does: {"role": ...} first, then {"content": ...}."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer
    def _only_set(self) -> dict[str, Any]:
        return {k: v for k, v in (("role", self.role), ("content", self.content))
                if v is not None}


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


# ---- models, tokenize --------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "shoal"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class MultiModalPlaceholder(BaseModel):
    """An image's (or video's) span in the expanded prompt and the engine's content hash of
    it: what the prefix-cache hashes of the blocks over the span mix in (the cache-aware
    router rebuilds the engine's block hashes from these)."""

    modality: str
    identifier: str
    offset: int
    length: int


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None
    # set for a chat with images or videos (tokens: the expanded prompt); left out otherwise
    mm_placeholders: list[MultiModalPlaceholder] | None = None

    def body(self) -> dict[str, Any]:
        return self.model_dump(exclude={"mm_placeholders"} if self.mm_placeholders is None
                               else None)


class DetokenizeResponse(BaseModel):
    prompt: str
