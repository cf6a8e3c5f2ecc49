"""Prompts in: text or token ids or chat messages -> validated token ids (frontend side)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


class InputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

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
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise ValueError("prompt_token_ids must be a list of integers")
        ids = list(ids)
        if not ids:
            raise ValueError("prompt must not be empty (prompt_token_ids is empty)")
        if set(map(type, ids)) != {int}:  # C speed; the scan below only names the culprit
            bad = next(t for t in ids if type(t) is not int)
            raise ValueError(f"prompt_token_ids must be integers (got {bad!r})")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = next(t for t in ids if t < 0 or t >= self.vocab_size)
            raise ValueError(f"prompt_token_ids must be in [0, {self.vocab_size}) (got {bad})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens; it must be shorter than max_model_len "
                f"({self.max_model_len})"
            )
        return ProcessedPrompt(text, ids)

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
