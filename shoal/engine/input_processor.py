"""The one place requests are validated and tokenized, for every frontend and the core.

Prompts come in as text, token ids or chat messages and leave as validated token ids; a
request leaves as the EngineCoreRequests of its n samples. The offline `LLMEngine`, the
server's `AsyncLLM` and the `EngineCore` (which checks again, in case a request bypassed a
frontend) all validate through `validate_core_request` (request_checks.py, with the other checks),
against the `EngineLimits` the core reports once it has sized its KV pool, so a frontend
needs the tokenizer and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shoal.core.types import EngineCoreRequest
from shoal.engine.bad_words import with_bad_words
from shoal.engine.chat_template import render_chat_template
from shoal.engine.generation_defaults import with_generation_eos
from shoal.engine.prompt_checks import check_prompt_token_ids
from shoal.engine.request_checks import (
    NO_SAMPLING,
    EngineLimits,
    check_request_limits,
    check_request_options,
    check_text,
    resolve_logprobs,
    validate_core_request,
    wrong_runner_message,
)
from shoal.engine.thinking_markers import with_thinking_markers
from shoal.lora_request import LoRARequest
from shoal.multimodal.inputs import MultiModalFeature
from shoal.pooling_params import PoolingParams
from shoal.prompt_truncation import (
    GENERATION_SIDE,
    encode_kept,
    kept_tokens,
    pooling_side,
    truncate_prompt,
)
from shoal.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from shoal.engine.mm_frontend import MultiModalFrontend


@dataclass
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]
    mm_features: list[MultiModalFeature] | None = None  # its images (placeholders expanded)


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


class InputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, limits: EngineLimits,
                 max_logprobs: int = 20, mm: MultiModalFrontend | None = None):
        self.tokenizer = tokenizer
        self.limits = limits
        self.max_logprobs = max_logprobs
        self.mm = mm  # images: a vision-language model's frontend (shoal/multimodal)

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    # ---- whole requests ---------------------------------------------------------------------
    def process_request(self, request_id: str, prompt: PromptType, params: SamplingParams, *,
                        priority: int = 0, cache_salt: str | None = None,
                        arrival_time: float | None = None,
                        lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """Everything that can be wrong with a request raises ValueError here, before any of
        it reaches a core."""
        check_request_options(params, priority, cache_salt)
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest (got "
                             f"{type(lora_request).__name__})")
        check_request_limits(self.limits.request, params)
        params = resolve_logprobs(params, self.max_logprobs, self.limits.vocab_size)
        params = with_thinking_markers(params, self.tokenizer)
        params = with_bad_words(params, self.tokenizer)
        params = with_generation_eos(params, self.limits.generation.eos_token_ids)
        p = self._cut(prompt, params.truncate_prompt_tokens) \
            if isinstance(prompt, ProcessedPrompt) \
            else self.process(prompt, truncate=params.truncate_prompt_tokens)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        n = params.n
        reqs = [EngineCoreRequest(child_request_id(request_id, i, n), p.prompt_token_ids,
                                  params.for_sample(i) if n > 1 else params, arrival, priority,
                                  cache_salt, lora=lora_request, mm_features=p.mm_features)
                for i in range(n)]
        for r in reqs:
            validate_core_request(self.limits, r)
        return ProcessedRequest(request_id, p.prompt, p.prompt_token_ids, params, reqs)

    def process_pooling_request(self, request_id: str, prompt: PromptType,
                                params: PoolingParams, *, priority: int = 0,
                                token_type_ids: list[int] | None = None,
                                arrival_time: float | None = None) -> ProcessedRequest:
        """A pooling request (embed, classify, score): one core request, no sampling."""
        if not isinstance(params, PoolingParams):
            raise ValueError("pooling_params must be a PoolingParams")
        check_request_options(NO_SAMPLING, priority, None)
        if self.limits.pooling is None:
            raise ValueError(wrong_runner_message(False))
        p = prompt if isinstance(prompt, ProcessedPrompt) else self.process_pooling_prompt(
            prompt, params.truncate_prompt_tokens)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        req = EngineCoreRequest(request_id, p.prompt_token_ids, NO_SAMPLING, arrival, priority,
                                pooling_params=params, token_type_ids=token_type_ids)
        validate_core_request(self.limits, req)
        return ProcessedRequest(request_id, p.prompt, p.prompt_token_ids, NO_SAMPLING, [req])

    def process_pooling_prompt(self, prompt: Any, truncate: int | None = None
                               ) -> ProcessedPrompt:
        """Text or token ids of a pooling request, cut to `truncate` tokens when given
        (PoolingParams.truncate_prompt_tokens); length is checked against max_model_len
        inclusive (nothing is generated after the prompt). Empty text is refused, as
        OpenAI's embeddings refuse it, though BERT would read [CLS] [SEP]."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("input must not be empty")
            ids = encode_kept(lambda special: self.encode(prompt, special, "input"),
                              self._kept(truncate, self.limits.max_model_len),
                              pooling_side(self.tokenizer))
            self.check_pooling_length(len(ids))
            return ProcessedPrompt(prompt, ids)
        if isinstance(prompt, Mapping) and "prompt" in prompt and "prompt_token_ids" not in prompt:
            return self.process_pooling_prompt(prompt["prompt"], truncate)
        if isinstance(prompt, Mapping):
            prompt = prompt.get("prompt_token_ids")
        if isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes)):
            if not prompt:
                raise ValueError("input must not be empty")
            keep = self._kept(truncate, self.limits.max_model_len)
            prompt = truncate_prompt(list(prompt), keep, pooling_side(self.tokenizer))
            self.check_pooling_length(len(prompt))
            ids = check_prompt_token_ids(prompt, self.limits.vocab_size,
                                         self.limits.max_model_len + 1)
            return ProcessedPrompt(None, ids)
        raise ValueError(f"input must be a string or token ids (got {type(prompt).__name__})")

    def encode_pair(self, text_1: str, text_2: str) -> tuple[list[int], list[int] | None]:
        """A (query, document) pair as a cross-encoder reads it: both texts in one sequence
        ([CLS] q [SEP] d [SEP] for BERT), with segment ids when the tokenizer makes them."""
        if self.tokenizer is None:
            raise ValueError("scoring text pairs needs a tokenizer")
        for t, what in ((text_1, "text_1"), (text_2, "text_2")):
            if not isinstance(t, str) or not t:
                raise ValueError(f"{what} must be a non-empty string")
            check_text(t, what)
        enc = self.tokenizer(text_1, text_2)
        ids = list(enc["input_ids"])
        self.check_pooling_length(len(ids))
        tt = enc.get("token_type_ids")
        return ids, (list(tt) if tt is not None and any(tt) else None)

    def check_pooling_length(self, n: int) -> None:
        if n > self.limits.max_model_len:
            raise ValueError(f"This model's maximum context length is "
                             f"{self.limits.max_model_len} tokens. However, your input is {n} "
                             f"tokens (max_model_len)")

    def check_num_prompts(self, count: int) -> None:
        """A request carrying `count` prompts (a completion's prompt list): checked before any
        of them is tokenized."""
        limit = self.limits.request.max_prompts_per_request
        if count > limit:
            raise ValueError(f"the request has {count} prompts; at most max_prompts_per_request "
                             f"({limit}) are allowed")

    # ---- prompts ----------------------------------------------------------------------------
    def process(self, prompt: str | Mapping[str, Any] | Sequence[int], *,
                add_special_tokens: bool = True, truncate: int | None = None
                ) -> ProcessedPrompt:
        """Accepts a string, {"prompt": str}, {"prompt_token_ids": [...]}, or a list of ids;
        a dict may carry images ({"multi_modal_data": {"image": ...}}). truncate: keep that
        many tokens (SamplingParams.truncate_prompt_tokens; -1: all but one of
        max_model_len), dropped from the left (vLLM's generation side), a text's special
        tokens kept."""
        if isinstance(prompt, Mapping) and prompt.get("multi_modal_data") is not None:
            if truncate is not None:  # (a cut could split an image's placeholder run)
                raise ValueError("truncate_prompt_tokens does not apply to prompts with "
                                 "images (multi_modal_data)")
            return self.with_images(self.process({k: v for k, v in prompt.items()
                                                  if k != "multi_modal_data"},
                                                 add_special_tokens=add_special_tokens),
                                    prompt["multi_modal_data"])
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return self._from_ids(prompt["prompt_token_ids"], prompt.get("prompt"),
                                      truncate)
            if "prompt" in prompt:
                return self._from_text(prompt["prompt"], add_special_tokens, truncate)
            raise ValueError("prompt dict must have 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return self._from_text(prompt, add_special_tokens, truncate)
        if isinstance(prompt, Sequence):
            return self._from_ids(prompt, None, truncate)
        raise ValueError(f"prompt must be a string or token ids (got {type(prompt).__name__})")

    def _from_text(self, text: Any, add_special_tokens: bool = True,
                   truncate: int | None = None) -> ProcessedPrompt:
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string (got {type(text).__name__})")
        if not text:
            raise ValueError("prompt must not be empty")
        # (its special tokens stay, as a tokenizer's truncation keeps them; the text stays
        # the request's prompt, as vLLM's RequestOutput.prompt)
        keep = self._kept(truncate, self.limits.max_model_len - 1)
        if add_special_tokens:
            ids = encode_kept(lambda special: self.encode(text, special), keep, GENERATION_SIDE)
        else:
            ids = truncate_prompt(self.encode(text, False), keep, GENERATION_SIDE)
        return self._from_ids(ids, text)

    def _kept(self, truncate: int | None, max_input: int) -> int | None:
        return kept_tokens(truncate, self.limits.max_model_len, max_input)

    def encode(self, text: str, add_special_tokens: bool = True, what: str = "prompt"
               ) -> list[int]:
        """Text -> token ids, for every caller (/tokenize included): the text must be valid
        Unicode, which the tokenizer would otherwise reject with a TypeError."""
        if self.tokenizer is None:
            raise ValueError("this server runs without a tokenizer (--skip-tokenizer-init): "
                             "pass token ids")
        check_text(text, what)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def with_images(self, p: ProcessedPrompt, mm_data: Any) -> ProcessedPrompt:
        """The prompt with its images' placeholders expanded (and its length checked again)."""
        if self.mm is None:
            raise ValueError("this model does not take images (multi_modal_data)")
        ids, features = self.mm.process(p.prompt_token_ids, mm_data)
        return ProcessedPrompt(p.prompt, self._from_ids(ids, None).prompt_token_ids,
                               features or None)

    def _from_ids(self, ids: Any, text: str | None, truncate: int | None = None
                  ) -> ProcessedPrompt:
        lim = self.limits
        if truncate is not None and isinstance(ids, Sequence) and not isinstance(ids, str):
            keep = self._kept(truncate, lim.max_model_len - 1)
            kept = truncate_prompt(list(ids), keep, GENERATION_SIDE)
            text = text if len(kept) == len(ids) else None  # (the text is no longer the prompt)
            ids = kept
        return ProcessedPrompt(text, check_prompt_token_ids(ids, lim.vocab_size,
                                                            lim.max_model_len))

    # ---- chat -------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[Mapping[str, Any]], *,
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False,
                            chat_template: str | None = None,
                            chat_template_kwargs: Mapping[str, Any] | None = None) -> str:
        """Any role the template handles passes (system, user, assistant, developer or a
        custom one); the template itself decides what it accepts."""
        if self.tokenizer is None:
            raise ValueError("this server runs without a tokenizer (--skip-tokenizer-init), so "
                             "it has no chat template")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or "role" not in m:
                raise ValueError(f"messages[{i}] must be an object with a 'role'")
            if not isinstance(m["role"], str) or not m["role"]:
                raise ValueError(f"messages[{i}].role must be a non-empty string")
            if not isinstance(m.get("content", ""), str):
                raise ValueError(f"messages[{i}].content must be a string")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt to be false")
        template = chat_template or getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, Mapping):  # named templates: the default one
            template = template.get("default")
        if not template or not isinstance(template, str):
            raise ValueError("the model has no chat template; pass chat_template")
        # Rendered in a sandbox with limits (chat_template.py), as transformers would render
        # it: the tokenizer's special tokens are variables, the request's kwargs override them.
        variables = {**getattr(self.tokenizer, "special_tokens_map", {}),
                     **dict(chat_template_kwargs or {})}
        return render_chat_template(
            template, [dict(m) for m in messages], variables=variables,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, max_model_len=self.max_model_len)

    def process_chat(self, messages: list[Mapping[str, Any]], *,
                     add_special_tokens: bool = False, truncate: int | None = None,
                     **kwargs: Any) -> ProcessedPrompt:
        """truncate: SamplingParams.truncate_prompt_tokens, cut from the rendered ids."""
        text = self.apply_chat_template(messages, **kwargs)
        # The template already placed any special tokens (vLLM's add_special_tokens=False).
        ids = self.encode(text, add_special_tokens,
                          "the chat (messages rendered by the chat template)")
        return self._from_ids(ids, text, truncate)

    def _cut(self, p: ProcessedPrompt, truncate: int | None) -> ProcessedPrompt:
        """An already processed prompt cut to `truncate` tokens (none: itself)."""
        if truncate is None:
            return p
        if p.mm_features:  # (a cut could split an image's placeholder run)
            raise ValueError("truncate_prompt_tokens does not apply to prompts with images "
                             "(multi_modal_data)")
        return self._from_ids(p.prompt_token_ids, p.prompt, truncate)
