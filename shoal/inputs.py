"""The prompt shapes `LLM.generate`, `encode` and friends take, named as vLLM's
(`vllm.inputs`): a plain string, or one of these dicts. They are TypedDicts: a dict literal
with the same keys is the same thing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NotRequired, TypedDict


class TextPrompt(TypedDict):
    prompt: str  # tokenized with the model's tokenizer (its special tokens added)
    multi_modal_data: NotRequired[dict[str, Any]]  # {"image": one image or a list}


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]  # used as given
    prompt: NotRequired[str]  # the text they came from, reported back in the output
    multi_modal_data: NotRequired[dict[str, Any]]


PromptType = str | TextPrompt | TokensPrompt


def prompt_list(prompts: Any) -> list[Any]:
    """The prompts argument of generate / encode as a list: one string, dict or flat list of
    token ids is one prompt (vLLM's parsing); anything else must be a list of prompts."""
    if isinstance(prompts, (str, Mapping)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a prompt (a string, a dict or token ids) or a "
                         f"list of prompts (got {type(prompts).__name__})")
    if prompts and all(type(t) is int for t in prompts):
        return [list(prompts)]
    return list(prompts)
