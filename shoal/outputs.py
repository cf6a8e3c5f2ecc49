"""What the offline API and the server hand back (shaped like vLLM's)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shoal.core.errors import ErrorCode


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None  # why the engine failed it (finish_reason "error")
    error_code: ErrorCode | None = None  # the kind of failure, set with error
    # disaggregated prefill: where a decode engine fetches this request's KV (a producer's)
    kv_transfer_params: dict[str, Any] | None = None


# ---- pooling (embeddings, classification, scores), shaped like vLLM's ---------------------

@dataclass
class PoolingOutput:
    """The raw pooled result: a float32 array ([D], [tokens, D] or [num_labels]); a numpy
    array from the server's engine, a torch tensor from the offline LLM (as vLLM's)."""

    data: Any


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput | None  # None when the request failed (see error)
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    error: str | None = None
    prompt: str | None = None
    error_code: ErrorCode | None = None  # the kind of failure, set with error


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool


@dataclass
class ClassificationOutput:
    probs: list[float]  # softmax over the labels (sigmoid for one label)

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool
