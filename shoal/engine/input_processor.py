"""The one place requests are validated and tokenized, for every frontend and the core.

Prompts come in as text, token ids or chat messages and leave as validated token ids; a
request leaves as the EngineCoreRequests of its n samples. The offline `LLMEngine`, the
server's `AsyncLLM` and the `EngineCore` (which checks again, in case a request bypassed a
frontend) all validate through `validate_core_request`, against the `EngineLimits` the core
reports once it has sized its KV pool, so a frontend needs the tokenizer and nothing else.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from shoal.core.types import EngineCoreRequest
from shoal.engine.chat_template import render_chat_template
from shoal.engine.prompt_checks import check_prompt_token_ids
from shoal.engine.thinking_markers import with_thinking_markers
from shoal.kv_offload.request_params import check_tier_names
from shoal.lora.adapter import LoRALimits, check_adapter
from shoal.lora_request import LoRARequest
from shoal.multimodal.inputs import MultiModalFeature, check_features
from shoal.pooling_params import PoolingInfo, PoolingParams
from shoal.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from shoal.engine.mm_frontend import MultiModalFrontend


class RequestLimits(msgspec.Struct, frozen=True):
    """How much one request may ask for (engine arguments of the same names; the defaults
    are theirs). Each is answered with a ValueError naming it, so a server answers 400."""

    max_n: int = 128
    max_prompts_per_request: int = 1024
    max_stop_strings: int = 64
    max_stop_string_length: int = 1024
    request_timeout: float | None = None  # seconds from arrival; enforced by the scheduler

    def __post_init__(self) -> None:
        for name in ("max_n", "max_prompts_per_request", "max_stop_strings",
                     "max_stop_string_length"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer (got {getattr(self, name)!r})")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds (got {self.request_timeout})")

    @classmethod
    def from_engine_args(cls, args: Any) -> RequestLimits:
        return cls(**{f: getattr(args, f) for f in cls.__struct_fields__})


class EngineLimits(msgspec.Struct, frozen=True):
    """What a request is checked against; the engine's ready message carries it."""

    vocab_size: int
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    max_num_seqs: int
    eos_token_ids: frozenset[int] = frozenset()
    # KV cache groups of linear-attention states: a request holds, beside its KV table, a
    # block per group for its state and one per block end a prompt chunk reaches
    # (kv_cache_spec.LinearStateSpec)
    state_groups: int = 0
    max_num_batched_tokens: int = 0  # the longest prompt chunk (0: unknown, a whole prompt)
    request: RequestLimits = msgspec.field(default_factory=RequestLimits)
    pooling: PoolingInfo | None = None  # set: a pooling engine (runner="pooling")
    lora: LoRALimits | None = None  # set: the engine serves LoRA adapters (enable_lora)
    # images: the most encoder outputs one image may have (0: the model reads no images)
    mm_max_embeds: int = 0
    mm_whole_spans: bool = False  # an image runs within one step (at most the token budget)


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


def validate_core_request(limits: EngineLimits, req: EngineCoreRequest) -> int:
    """Checks a request against the model and the KV pool; returns its resolved max_tokens."""
    if (limits.pooling is not None) != (req.pooling_params is not None):
        raise ValueError(wrong_runner_message(limits.pooling is not None))
    if req.pooling_params is not None:
        validate_pooling_request(limits, req)
        return 1
    ids = check_prompt_token_ids(req.prompt_token_ids, limits.vocab_size, limits.max_model_len)
    if req.lora is not None:
        check_adapter(req.lora.lora_path, limits.lora)
    if req.mm_features:
        check_features(req.mm_features, len(ids), limits.mm_max_embeds,
                       limits.max_num_batched_tokens if limits.mm_whole_spans else 0)
    sp = req.sampling_params
    sp.validate_against_vocab(limits.vocab_size)
    check_tier_names(sp.kv_transfer_params)
    for name in ("logprobs", "prompt_logprobs"):  # -1 is resolved by the frontend
        k = getattr(sp, name)
        if k is not None and not 0 <= k <= limits.vocab_size:
            raise ValueError(f"{name} must be in [0, {limits.vocab_size}] (got {k})")
    room = limits.max_model_len - len(ids)
    max_tokens = room if sp.max_tokens is None else min(sp.max_tokens, room)
    need = -(-(len(ids) + max_tokens) // limits.block_size)
    chunk = min(len(ids), limits.max_num_batched_tokens or len(ids))
    need += limits.state_groups * (1 + -(-chunk // limits.block_size))
    if need > limits.num_kv_blocks:
        raise ValueError(
            f"the request needs up to {need} KV blocks but the pool has {limits.num_kv_blocks}; "
            "lower max_tokens or give the KV cache more memory")
    return max_tokens


def wrong_runner_message(pooling_model: bool) -> str:
    if pooling_model:
        return ("this model runs as a pooling model (embeddings, classification, scores): it "
                "does not generate text")
    return ("this model generates text: embeddings, classification and scores need a pooling "
            "model (runner='pooling', or an encoder model such as all-MiniLM-L6-v2)")


def validate_pooling_request(limits: EngineLimits, req: EngineCoreRequest) -> None:
    assert limits.pooling is not None and req.pooling_params is not None
    ids = list(req.prompt_token_ids)
    if not ids:
        raise ValueError("input must not be empty (no tokens)")
    if len(ids) > limits.max_model_len:
        raise ValueError(f"This model's maximum context length is {limits.max_model_len} "
                         f"tokens. However, your input is {len(ids)} tokens (max_model_len)")
    # (a pooling prompt may fill max_model_len: nothing is generated after it)
    check_prompt_token_ids(ids, limits.vocab_size, limits.max_model_len + 1)
    req.pooling_params.check_against(limits.pooling)
    tt = req.token_type_ids
    if tt is not None and (len(tt) != len(ids) or not set(tt) <= {0, 1}):
        raise ValueError("token_type_ids must hold one 0 or 1 per input token")


# The sampling parameters a pooling request carries: nothing is sampled or detokenized.
_NO_SAMPLING = SamplingParams(max_tokens=1, detokenize=False)
_INT64 = (-(2**63), 2**63 - 1)
_UINT64_MAX = 2**64 - 1  # seeds: torch takes [-2**63, 2**64 - 1]


def _check_wire_ints(params: SamplingParams) -> None:
    """Every integer must cross to the engine process (msgpack: at most 64 bits)."""
    for f in dataclasses.fields(params):
        value = getattr(params, f.name)
        if isinstance(value, dict):
            values: Any = [*value.keys(), *value.values()]
        elif isinstance(value, (list, tuple, set, frozenset)):
            values = value
        else:
            values = [value]
        hi = _UINT64_MAX if f.name == "seed" else _INT64[1]
        for v in values:
            if isinstance(v, int) and not _INT64[0] <= v <= hi:
                raise ValueError(f"{f.name} must be a 64-bit integer (got {v})")


def check_request_limits(limits: RequestLimits, params: SamplingParams) -> None:
    """The limits of one request's sampling parameters (before any per-sample work)."""
    _check_wire_ints(params)
    if params.n > limits.max_n:
        raise ValueError(f"n must be <= max_n ({limits.max_n}); got {params.n}. The server's "
                         "--max-n flag raises the limit")
    stop = params.stop or []
    if len(stop) > limits.max_stop_strings:
        raise ValueError(f"stop has {len(stop)} strings; at most max_stop_strings "
                         f"({limits.max_stop_strings}) are allowed")
    longest = max(map(len, stop), default=0)
    if longest > limits.max_stop_string_length:
        raise ValueError(f"stop strings must be at most max_stop_string_length "
                         f"({limits.max_stop_string_length}) characters; one has {longest}")


def check_text(text: str, what: str = "prompt") -> None:
    """Text must be valid Unicode: a lone surrogate (which JSON can carry as \\ud800) cannot be
    encoded, so no tokenizer can read it."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what} is not valid Unicode: {text[e.start]!r} at character "
                         f"{e.start} is a lone surrogate") from None


def _check_request_options(params: Any, priority: Any, cache_salt: Any) -> None:
    if not isinstance(params, SamplingParams):
        raise ValueError("sampling_params must be a SamplingParams")
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ValueError(f"priority must be an integer (got {priority!r})")
    if not _INT64[0] <= priority <= _INT64[1]:
        raise ValueError(f"priority must be a 64-bit integer (got {priority})")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise ValueError("cache_salt must be a non-empty string")


def resolve_logprobs(params: SamplingParams, max_logprobs: int, vocab_size: int
                     ) -> SamplingParams:
    """Checks logprobs and prompt_logprobs against the engine's max_logprobs (vLLM's
    --max-logprobs: 20 by default, -1 for no limit) and turns -1 (the whole vocabulary) into
    the vocabulary size. Returns `params` itself when nothing changes."""
    limit = vocab_size if max_logprobs == -1 else max_logprobs
    resolved = {}
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is None:
            continue
        n = vocab_size if k == -1 else k
        if n > limit:
            what = "the whole vocabulary (-1)" if k == -1 else str(k)
            raise ValueError(f"{name} must be <= max_logprobs ({max_logprobs}); got {what}. "
                             "The server's --max-logprobs flag raises the limit (-1: none)")
        if n != k:
            resolved[name] = n
    return dataclasses.replace(params, **resolved) if resolved else params


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
        _check_request_options(params, priority, cache_salt)
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest (got "
                             f"{type(lora_request).__name__})")
        check_request_limits(self.limits.request, params)
        params = resolve_logprobs(params, self.max_logprobs, self.limits.vocab_size)
        params = with_thinking_markers(params, self.tokenizer)
        p = prompt if isinstance(prompt, ProcessedPrompt) else self.process(prompt)
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
        _check_request_options(_NO_SAMPLING, priority, None)
        if self.limits.pooling is None:
            raise ValueError(wrong_runner_message(False))
        p = prompt if isinstance(prompt, ProcessedPrompt) else self.process_pooling_prompt(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        req = EngineCoreRequest(request_id, p.prompt_token_ids, _NO_SAMPLING, arrival, priority,
                                pooling_params=params, token_type_ids=token_type_ids)
        validate_core_request(self.limits, req)
        return ProcessedRequest(request_id, p.prompt, p.prompt_token_ids, _NO_SAMPLING, [req])

    def process_pooling_prompt(self, prompt: Any) -> ProcessedPrompt:
        """Text or token ids of a pooling request; length is checked against max_model_len
        inclusive (nothing is generated after the prompt)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("input must not be empty")
            ids = self.encode(prompt, what="input")
            self.check_pooling_length(len(ids))
            return ProcessedPrompt(prompt, ids)
        if isinstance(prompt, Mapping) and "prompt" in prompt and "prompt_token_ids" not in prompt:
            return self.process_pooling_prompt(prompt["prompt"])
        if isinstance(prompt, Mapping):
            prompt = prompt.get("prompt_token_ids")
        if isinstance(prompt, Sequence) and not isinstance(prompt, (str, bytes)):
            if not prompt:
                raise ValueError("input must not be empty")
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
                add_special_tokens: bool = True) -> ProcessedPrompt:
        """Accepts a string, {"prompt": str}, {"prompt_token_ids": [...]}, or a list of ids;
        a dict may carry images ({"multi_modal_data": {"image": ...}})."""
        if isinstance(prompt, Mapping) and prompt.get("multi_modal_data") is not None:
            return self.with_images(self.process({k: v for k, v in prompt.items()
                                                  if k != "multi_modal_data"},
                                                 add_special_tokens=add_special_tokens),
                                    prompt["multi_modal_data"])
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return self._from_ids(prompt["prompt_token_ids"], prompt.get("prompt"))
            if "prompt" in prompt:
                return self._from_text(prompt["prompt"], add_special_tokens)
            raise ValueError("prompt dict must have 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return self._from_text(prompt, add_special_tokens)
        if isinstance(prompt, Sequence):
            return self._from_ids(prompt, None)
        raise ValueError(f"prompt must be a string or token ids (got {type(prompt).__name__})")

    def _from_text(self, text: Any, add_special_tokens: bool = True) -> ProcessedPrompt:
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string (got {type(text).__name__})")
        if not text:
            raise ValueError("prompt must not be empty")
        return self._from_ids(self.encode(text, add_special_tokens), text)

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

    def _from_ids(self, ids: Any, text: str | None) -> ProcessedPrompt:
        lim = self.limits
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
                     add_special_tokens: bool = False, **kwargs: Any) -> ProcessedPrompt:
        text = self.apply_chat_template(messages, **kwargs)
        # The template already placed any special tokens (vLLM's add_special_tokens=False).
        ids = self.encode(text, add_special_tokens,
                          "the chat (messages rendered by the chat template)")
        return self._from_ids(ids, text)
