"""Per-request pooling parameters (vLLM's PoolingParams field names), validated on creation.

A pooling request runs one forward over its prompt and finishes: no sampling, no KV cache.
What the engine can check only against the model (dimensions against a Matryoshka model, a
task the model has no head for) is checked by `check_against` with the model's PoolingInfo."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from shoal.prompt_truncation import check_truncate_prompt_tokens

# embed: one vector per prompt; token_embed: one per token (ALL pooling); classify: class
# probabilities; score: one relevance number for a (query, document) pair; token_classify:
# one number per token (BGE-M3's sparse lexical weights).
POOLING_TASKS = ("embed", "token_embed", "classify", "score", "token_classify")


class PoolingInfo(msgspec.Struct, frozen=True):
    """What a pooling model offers, sent to the frontends in the engine's limits."""

    tasks: tuple[str, ...]
    hidden_size: int
    pooling_type: str  # the embed task's default: CLS, MEAN or LAST
    normalize: bool  # the embed task's default
    num_labels: int = 0  # classification heads only
    id2label: dict[int, str] = msgspec.field(default_factory=dict)
    matryoshka_dimensions: tuple[int, ...] | None = None  # None: not Matryoshka-trained
    is_matryoshka: bool = False
    is_cross_encoder: bool = False  # a one-label classifier that scores pairs


@dataclass
class PoolingParams:
    task: str = "embed"
    dimensions: int | None = None  # Matryoshka truncation of an embedding
    normalize: bool | None = None  # None: the model's default (sentence-transformers files)
    use_activation: bool | None = None  # softmax/sigmoid on classify/score; None: on
    # Keep only this many input tokens (-1: max_model_len), dropped from the tokenizer's
    # truncation side (BERT's: the right); a text's special tokens stay
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        if self.task not in POOLING_TASKS:
            raise ValueError(f"task must be one of {', '.join(POOLING_TASKS)} (got {self.task!r})")
        if self.dimensions is not None:
            if isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int):
                raise ValueError(f"dimensions must be an integer (got {self.dimensions!r})")
            if self.dimensions < 1:
                raise ValueError(f"dimensions must be >= 1 (got {self.dimensions})")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool (got {value!r})")

    def check_against(self, info: PoolingInfo) -> None:
        """Raises ValueError when the model cannot do what these parameters ask."""
        if self.task not in info.tasks:
            raise ValueError(f"task {self.task!r} is not supported by this model; it supports "
                             f"{', '.join(info.tasks)}")
        if self.dimensions is not None:
            if self.task not in ("embed", "token_embed"):
                raise ValueError("dimensions only applies to embeddings")
            if not info.is_matryoshka:
                raise ValueError("dimensions is not supported: the model does not support "
                                 "matryoshka representation, changing output dimensions "
                                 "would give poor results")
            allowed = info.matryoshka_dimensions
            if allowed and self.dimensions not in allowed:
                raise ValueError(f"dimensions must be one of the model's matryoshka "
                                 f"dimensions {list(allowed)} (got {self.dimensions})")
            if self.dimensions > info.hidden_size:
                raise ValueError(f"dimensions must be <= the embedding size "
                                 f"{info.hidden_size} (got {self.dimensions})")
