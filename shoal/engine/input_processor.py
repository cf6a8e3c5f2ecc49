"""The one place requests are validated and tokenized, for every frontend and the core.

Prompts come in as text, token ids or chat messages and leave as validated token ids; a
request leaves as the EngineCoreRequests of its n samples. The offline `LLMEngine`, the
server's `AsyncLLM` and the `EngineCore` (which checks again, in case a request bypassed a
frontend) all validate through `validate_core_request`, against the `EngineLimits` the core
reports once it has sized its KV pool, so a frontend needs the tokenizer and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from shoal.engine.core_types import EngineCoreRequest
from shoal.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class EngineLimits(msgspec.Struct, frozen=True):
    """What a request is checked against; the engine's ready message carries it."""

    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    eos_token_ids: frozenset[int] = frozenset()


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


@dataclass
class ProcessedRequest:
    """A validated request: its prompt and one core request per sample (n of them)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    core_requests: list[EngineCoreRequest]


PromptType = str | Mapping[str, Any] | Sequence[int] | ProcessedPrompt


def child_request_id(parent_id: str, index: int, n: int) -> str:
    """The core's id of sample `index` of a request with n samples."""
    return parent_id if n == 1 else f"{index}_{parent_id}"


def check_prompt_token_ids(ids: Any, vocab_size: int, max_model_len: int) -> list[int]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError("prompt_token_ids must be a list of integers")
    ids = list(ids)
    if not ids:
        raise ValueError("prompt must not be empty (prompt_token_ids is empty)")
    # C-speed checks first (a 4k-token prompt is checked on every request's critical path);
    # the Python scans only run to name the offending id.
    if set(map(type, ids)) != {int}:
        bad = next(t for t in ids if type(t) is not int)
        raise ValueError(f"prompt_token_ids must be integers (got {bad!r})")
    if min(ids) < 0 or max(ids) >= vocab_size:
        bad = next(t for t in ids if t < 0 or t >= vocab_size)
        raise ValueError(f"prompt_token_ids must be in [0, {vocab_size}) (got {bad})")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt is {len(ids)} tokens; it must be shorter than max_model_len "
                         f"({max_model_len})")
    return ids


def validate_core_request(limits: EngineLimits, req: EngineCoreRequest) -> int:
    """Checks a request against the model and the KV pool; returns its resolved max_tokens."""
    ids = check_prompt_token_ids(req.prompt_token_ids, limits.vocab_size, limits.max_model_len)
    sp = req.sampling_params
    sp.validate_against_vocab(limits.vocab_size)
    room = limits.max_model_len - len(ids)
    max_tokens = room if sp.max_tokens is None else min(sp.max_tokens, room)
    need = -(-(len(ids) + max_tokens) // limits.block_size)
    if need > limits.num_kv_blocks:
        raise ValueError(
            f"the request needs up to {need} KV blocks but the pool has {limits.num_kv_blocks}; "
            "lower max_tokens or give the KV cache more memory")
    return max_tokens


def _check_request_options(params: Any, priority: Any, cache_salt: Any) -> None:
    if not isinstance(params, SamplingParams):
        raise ValueError("sampling_params must be a SamplingParams")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer (got {priority!r})")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError("cache_salt must be a non-empty string")


class InputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, limits: EngineLimits):
        self.tokenizer = tokenizer
        self.limits = limits

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    # ---- whole requests ---------------------------------------------------------------------
    def process_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                        priority: int = 0, cache_salt: str | None = None,
                        arrival_time: float | None = None) -> ProcessedRequest:
        """Everything that can be wrong with a request raises ValueError here, before any of
        it reaches a core."""
        _check_request_options(params, priority, cache_salt)
        p = prompt if isinstance(prompt, ProcessedPrompt) else self.process(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        n = params.n
        reqs = [EngineCoreRequest(child_request_id(request_id, i, n), p.prompt_token_ids,
                                  params.for_sample(i) if n > 1 else params, arrival, priority,
                                  cache_salt)
                for i in range(n)]
        for r in reqs:
            validate_core_request(self.limits, r)
        return ProcessedRequest(request_id, p.prompt, p.prompt_token_ids, params, reqs)

    # ---- prompts ----------------------------------------------------------------------------
    def process(self, prompt: str | Mapping[str, Any] | Sequence[int]) -> ProcessedPrompt:
        """Accepts a string, {"prompt": str}, {"prompt_token_ids": [...]}, or a list of ids."""
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return self._from_ids(prompt["prompt_token_ids"], prompt.get("prompt"))
            if "prompt" in prompt:
                return self._from_text(prompt["prompt"])
            raise ValueError("prompt dict must have 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return self._from_text(prompt)
        if isinstance(prompt, Sequence):
            return self._from_ids(prompt, None)
        raise ValueError(f"prompt must be a string or token ids (got {type(prompt).__name__})")

    def _from_text(self, text: Any) -> ProcessedPrompt:
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string (got {type(text).__name__})")
        if not text:
            raise ValueError("prompt must not be empty")
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids")
        ids = self.tokenizer.encode(text, add_special_tokens=True)
        return self._from_ids(ids, text)

    def _from_ids(self, ids: Any, text: str | None) -> ProcessedPrompt:
        lim = self.limits
        return ProcessedPrompt(text, check_prompt_token_ids(ids, lim.vocab_size,
                                                            lim.max_model_len))

    # ---- chat -------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True,
                            chat_template: str | None = None,
                            chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise ValueError(f"messages[{i}] must be an object with a 'role'")
            if m["role"] not in ("system", "user", "assistant", "developer"):
                raise ValueError(
                    f"messages[{i}].role must be system, user or assistant (got {m['role']!r})"
                )
            if not isinstance(m.get("content", ""), str):
                raise ValueError(f"messages[{i}].content must be a string")
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if not template:
            raise ValueError("the model has no chat template; pass chat_template")
        return self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt,
            chat_template=template, **dict(chat_template_kwargs or {}),
        )

    def process_chat(self, messages: list[Mapping[str, Any]], **kwargs: Any) -> ProcessedPrompt:
        text = self.apply_chat_template(messages, **kwargs)
        # The template already placed any special tokens.
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self._from_ids(ids, text)
