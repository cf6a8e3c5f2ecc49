"""OpenAI request bodies (pydantic), with vLLM's extra sampling fields.

Types are strict: a string where a number belongs is a 400, not a silent conversion. Unknown
fields are kept (`extra="allow"`) and logged; the fields the API defines but shoal does not
support yet are refused by `unsupported()` with a message that says so.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from shoal.sampling_params import SamplingParams

Number = StrictFloat | StrictInt
TokenIds = list[StrictInt]


def check_context_length(prompt_len: int, max_tokens: int | None, max_model_len: int,
                         field: str = "max_tokens") -> None:
    """An explicit max_tokens must fit beside the prompt (the engine would silently clip
    it; OpenAI and vLLM answer 400)."""
    if max_tokens is not None and max_tokens >= 1 and prompt_len + max_tokens > max_model_len:
        raise ValueError(
            f"{field} is too large: this model's maximum context length is {max_model_len} "
            f"tokens, but {prompt_len + max_tokens} were requested ({prompt_len} in the prompt, "
            f"{max_tokens} in the completion)")


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool | None = False
    continuous_usage_stats: StrictBool | None = False


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: StrictStr | None = None
    n: StrictInt | None = 1
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    logit_bias: dict[str, Number] | None = None
    skip_special_tokens: StrictBool = True
    spaces_between_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    prompt_logprobs: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    priority: StrictInt = 0
    cache_salt: StrictStr | None = None
    # KV offloading per request, e.g. {"skip_tiers": ["disk"]}; validated by SamplingParams.
    kv_transfer_params: dict[str, Any] | None = None
    user: StrictStr | None = None
    best_of: StrictInt | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           prompt_logprobs: int | None) -> SamplingParams:
        """Raises ValueError (naming the field) for out-of-range values."""
        return SamplingParams(
            n=1 if self.n is None else self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            kv_transfer_params=self.kv_transfer_params,
        )

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for a field shoal cannot honour yet, else None."""
        n = 1 if self.n is None else self.n
        if self.best_of is not None and self.best_of > n:
            return "best_of", "best_of > n is not supported yet"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        return None


class CompletionRequest(SamplingRequest):
    # str | list[str] | list[int] | list[list[int]]; checked by serving_completion with
    # messages that say what is wrong instead of pydantic's union error list.
    prompt: Any = None
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported yet"
        return super().unsupported()


class ChatMessage(OpenAIBaseModel):
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.functions or self.function_call not in (None, "none"):
            return "functions", "function calling (functions) is not supported yet"
        if self.tool_choice not in (None, "none"):
            return "tool_choice", "tool calling is not supported yet (tool_choice must be 'none')"
        if self.tools and self.tool_choice != "none":
            return "tools", "tool calling is not supported yet (tools)"
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format", (
                f"response_format {self.response_format.get('type')!r} is not supported yet; "
                "only 'text'")
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs to be true"
        return super().unsupported()


class TokenizeRequest(OpenAIBaseModel):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: StrictStr | None = None
    tokens: TokenIds
