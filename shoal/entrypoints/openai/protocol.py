"""OpenAI request bodies (pydantic), with vLLM's extra sampling fields.

Types are strict: a string where a number belongs is a 400, not a silent conversion. Unknown
fields are kept (`extra="allow"`) and logged, as vLLM does; but a field vLLM or OpenAI defines
that shoal does not implement (`NOT_IMPLEMENTED`, or a declared field such as `tools`) is
refused by `unsupported()` with a 400 that names it: never a success that ignored it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)

from shoal.engine.generation_defaults import capped_max_tokens
from shoal.entrypoints.openai.constraints import GUIDED_FIELDS, request_constraint
from shoal.sampling_params import BeamSearchParams, SamplingParams
from shoal.structured_output.params import StructuredOutputsParams

Number = StrictFloat | StrictInt
TokenIds = list[StrictInt]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# vLLM's range for seeds: a signed 64-bit integer (torch.Generator's own range is wider).
Seed = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]



def _bool_text(value: Any) -> Any:
    """"true" / "false" (any case) as booleans: clients send chat's `logprobs` as text, and
    vLLM (pydantic's lax mode) takes it; any other string stays an error."""
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    return value


# A boolean that may come as "true" / "false" (only where clients are known to send it so).
TextBool = Annotated[StrictBool, BeforeValidator(_bool_text)]

# Field -> (its value that means "not used", why shoal refuses any other value).
NOT_IMPLEMENTED: dict[str, tuple[Any, str]] = {
    "guided_decoding_backend": (None, "a per-request backend is not supported (as in vLLM): "
                                      "the server's --structured-outputs-config picks it"),
    "logits_processors": (None, "logits_processors are not supported"),
    "prompt_embeds": (None, "prompt_embeds is not supported (token ids or text only)"),
    "include_reasoning": (True, "include_reasoning needs a reasoning parser, which is not "
                                "supported yet"),
    "repetition_detection": (None, "repetition_detection is not supported yet"),
    "stream_interval": (None, "stream_interval is not supported yet"),
    "vllm_xargs": (None, "vllm_xargs is not supported"),
    "ec_transfer_params": (None, "ec_transfer_params (encoder cache transfer) is not "
                                 "supported"),
    "routed_experts_prompt_start": (0, "routed experts are not reported"),
    "return_token_offsets": (False, "return_token_offsets is not supported yet"),
    "return_prompt_text": (None, "return_prompt_text is not supported yet"),
    "return_assistant_tokens_mask": (False, "return_assistant_tokens_mask is not supported"),
    "mm_processor_kwargs": (None, "multimodal inputs are not supported"),
    "media_io_kwargs": (None, "multimodal inputs are not supported"),
    "lora_request": (None, "lora_request is not a request field here: name the LoRA adapter "
                           "in `model` (--lora-modules or /v1/load_lora_adapter)"),
}


# Fields beam search cannot honour, with the values that mean "not used".
BEAM_SEARCH_IGNORES: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("top_p", (None, 1, 1.0)), ("top_k", (None, 0, -1)), ("min_p", (None, 0, 0.0)),
    ("presence_penalty", (None, 0, 0.0)), ("frequency_penalty", (None, 0, 0.0)),
    ("repetition_penalty", (None, 1, 1.0)), ("seed", (None,)), ("stop", (None, [], "")),
    ("stop_token_ids", (None, [])), ("min_tokens", (0,)), ("logit_bias", (None, {})),
    ("allowed_token_ids", (None,)), ("prompt_logprobs", (None,)), ("bad_words", (None, [])),
)


def _unset(value: Any, default: Any) -> bool:
    if value is None or value == default:
        return True
    return isinstance(value, (list, dict, str)) and not value


class RequestFieldError(ValueError):
    """A 400 about one request field, `param`, whose message does not start with its name."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class ContextLengthError(RequestFieldError):
    """Prompt plus completion past max_model_len; `param` names the completion's field (the
    message starts with vLLM's phrase, not with it)."""


def check_context_length(prompt_len: int, max_tokens: int | None, max_model_len: int,
                         field: str = "max_tokens") -> None:
    """An explicit max_tokens must fit beside the prompt (the engine would silently clip
    it; OpenAI and vLLM answer 400)."""
    if max_tokens is not None and max_tokens >= 1 and prompt_len + max_tokens > max_model_len:
        raise ContextLengthError(  # (vLLM's phrase, which clients match)
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
            f"{max_tokens} in the completion): {field} is too large", field)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted(k for k in (self.model_extra or {}) if k not in NOT_IMPLEMENTED)

    def not_implemented(self) -> tuple[str, str] | None:
        """(param, message) for the first field of NOT_IMPLEMENTED this request sets."""
        for name, value in (self.model_extra or {}).items():
            entry = NOT_IMPLEMENTED.get(name)
            if entry is not None and not _unset(value, entry[0]):
                return name, entry[1]
        return None


def _given(value: Any, defaults: Mapping[str, Any], name: str, fallback: Any) -> Any:
    """A request's field, else the generation config's default, else vLLM's."""
    return value if value is not None else defaults.get(name, fallback)


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
    seed: Seed | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    logit_bias: dict[str, Number] | None = None
    allowed_token_ids: TokenIds | None = None
    bad_words: list[StrictStr] | None = None  # vLLM's: words the output must not contain
    # reasoning models: thinking tokens before </think> is forced
    thinking_token_budget: StrictInt | None = None
    # The logprobs of exactly these ids at each generated position (needs logprobs set).
    logprob_token_ids: TokenIds | None = None
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
    # vLLM's prompt and output extensions
    truncate_prompt_tokens: Annotated[StrictInt, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    return_token_ids: StrictBool | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    request_id: StrictStr | None = None
    # Beam search (run by the frontend: shoal/entrypoints/beam_search.py); n is the width.
    use_beam_search: StrictBool = False
    length_penalty: Number = 1.0
    # A routing hint (related requests share it); one engine core serves them all alike.
    session_id: StrictStr | None = None
    # Output constraints (constraints.py): OpenAI's, vLLM's, and vLLM's older names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | StrictStr | None = None
    guided_regex: StrictStr | None = None
    guided_choice: list[StrictStr] | None = None
    guided_grammar: StrictStr | None = None
    guided_whitespace_pattern: StrictStr | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        """The request's output constraint; ValueError (400) when it is invalid."""
        legacy = {name: getattr(self, name) for name in GUIDED_FIELDS}
        legacy["guided_whitespace_pattern"] = self.guided_whitespace_pattern
        return request_constraint(self.response_format, self.structured_outputs, legacy)

    def stream_usage(self, force: bool = False) -> tuple[bool, bool]:
        """(usage chunk at the end, usage on every chunk) for a stream. force
        (--enable-force-include-usage): both, as vLLM does."""
        if self.stream and force:
            return True, True
        opts = self.stream_options
        final = bool(self.stream and opts is not None and opts.include_usage)
        return final, bool(final and opts.continuous_usage_stats)

    def to_sampling_params(self, max_tokens: int | None, logprobs: int | None,
                           prompt_logprobs: int | None,
                           structured_outputs: StructuredOutputsParams | None = None,
                           defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """Raises ValueError (naming the field) for out-of-range values. structured_outputs:
        the constraint (the request's own, or one its tool_choice implies). defaults: the
        model's generation config (generation_defaults.py) for the fields the request leaves
        unset; its max_tokens caps the request's, as vLLM's does."""
        d = defaults or {}
        max_tokens = capped_max_tokens(max_tokens, d)
        return SamplingParams(
            structured_outputs=structured_outputs,
            n=1 if self.n is None else self.n,
            temperature=_given(self.temperature, d, "temperature", 1.0),
            top_p=_given(self.top_p, d, "top_p", 1.0),
            top_k=_given(self.top_k, d, "top_k", 0),
            min_p=_given(self.min_p, d, "min_p", 0.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=_given(self.repetition_penalty, d, "repetition_penalty", 1.0),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            # The explicit ids replace the top-k, as in vLLM.
            logprobs=None if self.logprob_token_ids else logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias=dict(self.logit_bias) if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words or None,
            logprob_token_ids=self.logprob_token_ids or None,
            kv_transfer_params=self.kv_transfer_params,
            thinking_token_budget=self.thinking_token_budget,
        )

    def field_name(self, param: str | None) -> str | None:
        """The request's own name for a field an engine error names (error bodies):
        response_format where the constraint came from it."""
        if param == "structured_outputs" and self.response_format is not None \
                and self.structured_outputs is None:
            return "response_format"
        return param

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for a field shoal cannot honour (yet), else None."""
        bad = self.not_implemented()
        if bad is not None:
            return bad
        n = 1 if self.n is None else self.n
        if self.best_of is not None and self.best_of > n:
            return "best_of", "best_of > n is not supported yet"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed when stream is true"
        if self.logprob_token_ids and self.use_beam_search:
            return "logprob_token_ids", "logprob_token_ids is not supported with beam search"
        if self.use_beam_search and self.stream:
            return "use_beam_search", "streaming is not supported with beam search"
        if self.use_beam_search:
            conflict = self._beam_search_conflict()
            if conflict is not None:
                return conflict
        if self.length_penalty != 1.0 and not self.use_beam_search:
            return "length_penalty", "length_penalty only applies to beam search " \
                                     "(use_beam_search: true)"
        return None

    def _beam_search_conflict(self) -> tuple[str, str] | None:
        if (1 if self.n is None else self.n) < 1:
            return "n", f"n (the beam width) must be >= 1 (got {self.n})"
        for name, unused in BEAM_SEARCH_IGNORES:
            if getattr(self, name) not in unused:
                return name, (f"{name} is not supported with beam search (beams are ranked "
                              "by the model's raw logprobs)")
        return None

    def to_beam_search_params(self, max_tokens: int) -> BeamSearchParams:
        """n is the beam width; raises ValueError naming the field."""
        return BeamSearchParams(
            beam_width=1 if self.n is None else self.n,
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=0.0 if self.temperature is None else self.temperature,
            length_penalty=self.length_penalty,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(SamplingRequest):
    # str | list[str] | list[int] | list[list[int]]; checked by serving_completion with
    # messages that say what is wrong instead of pydantic's union error list.
    prompt: Any = None
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: StrictStr | None = None
    add_special_tokens: StrictBool = True

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix is not supported yet"
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens", "max_tokens must be >= 1 (0 only with echo, to score a prompt)"
        if self.logprob_token_ids and self.logprobs is None:
            return "logprob_token_ids", "when using logprob_token_ids, logprobs must be set"
        if self.logprob_token_ids and self.echo and self.max_tokens == 0:
            return "logprob_token_ids", ("logprob_token_ids is not supported with echo and "
                                         "max_tokens 0 (no token is generated)")
        if self.use_beam_search and self.echo and self.logprobs is not None:
            return "echo", "echo with logprobs is not supported with beam search (it computes " \
                           "no prompt logprobs)"
        if self.use_beam_search and self.max_tokens == 0:
            return "max_tokens", "beam search needs max_tokens >= 1"
        return super().unsupported()


class ChatMessage(OpenAIBaseModel):
    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None
    logprobs: TextBool | None = False
    top_logprobs: StrictInt | None = None
    echo: StrictBool = False
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    reasoning_effort: StrictStr | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    def field_name(self, param: str | None) -> str | None:
        """As SamplingRequest's; and the engine's logprobs is chat's top_logprobs (chat's
        logprobs is a switch), its prompt chat's messages."""
        param = super().field_name(param)
        return {"logprobs": "top_logprobs", "prompt": "messages"}.get(param, param)

    def unsupported(self) -> tuple[str, str] | None:
        if self.functions or self.function_call not in (None, "none"):
            return "functions", ("the deprecated functions / function_call are not supported: "
                                 "use tools and tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs to be true"
        if self.logprob_token_ids and not self.logprobs:
            return "logprob_token_ids", "when using logprob_token_ids, logprobs must be true"
        if self.continue_final_message and self.add_generation_prompt:
            return "continue_final_message", (
                "continue_final_message and add_generation_prompt cannot both be true")
        return super().unsupported()

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template gets besides the messages."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.tools:  # tool_choice "none": the model sees the tools but calls none
            kwargs.setdefault("tools", self.tools)
        if self.documents:
            kwargs.setdefault("documents", self.documents)
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs


class BatchChatCompletionRequest(ChatCompletionRequest):
    """/v1/chat/completions/batch: `messages` is a list of conversations; one choice each."""

    messages: Annotated[list[Annotated[list[ChatMessage], Field(min_length=1)]],  # type: ignore[assignment]
                        Field(min_length=1)]

    def unsupported(self) -> tuple[str, str] | None:
        if self.stream:
            return "stream", "the batch endpoint does not stream"
        if (1 if self.n is None else self.n) != 1:
            return "n", "the batch endpoint takes n = 1 (one choice per conversation)"
        if self.tools:
            return "tools", "the batch endpoint does not take tools"
        if self.use_beam_search:
            return "use_beam_search", "the batch endpoint does not run beam search"
        return super().unsupported()


class TokenizeRequest(OpenAIBaseModel):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None  # default: True for a prompt, False for chat
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool | None = False
    chat_template: StrictStr | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    documents: list[dict[str, Any]] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: StrictStr | None = None
    tokens: TokenIds
