"""The prompt shapes `LLM.generate`, `encode` and friends take, named as vLLM's
(`vllm.inputs`): a plain string, or one of these dicts. They are TypedDicts: a dict literal
with the same keys is the same thing."""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str  # tokenized with the model's tokenizer (its special tokens added)
    multi_modal_data: NotRequired[dict[str, Any]]  # {"image": one image or a list}


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]  # used as given
    prompt: NotRequired[str]  # the text they came from, reported back in the output
    multi_modal_data: NotRequired[dict[str, Any]]


PromptType = str | TextPrompt | TokensPrompt
