"""What a request must satisfy before it reaches a core: its sampling parameters against the
engine's limits (n, stop strings, 64-bit integers, logprobs), its prompt against the model
(vocabulary, context, KV pool, adapters, images) and a pooling request against the pooling
model. Everything raises ValueError naming the field; the input processor calls these, and
the core checks each request again as it arrives (validate_core_request)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import msgspec

from shoal.engine.generation_defaults import GenerationDefaults
from shoal.engine.prompt_checks import check_prompt_token_ids
from shoal.kv_offload.request_params import check_tier_names
from shoal.lora.adapter import LoRALimits, check_adapter
from shoal.multimodal.inputs import check_features
from shoal.pooling_params import PoolingInfo
from shoal.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shoal.core.types import EngineCoreRequest


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
    generation: GenerationDefaults = msgspec.field(default_factory=GenerationDefaults)


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
    if sp.bad_words:  # (the frontend turns them into bad_words_token_ids with its tokenizer)
        raise ValueError("bad_words reached the engine untokenized: give bad_words_token_ids, "
                         "or submit through a frontend with a tokenizer")
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
NO_SAMPLING = SamplingParams(max_tokens=1, detokenize=False)
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


def check_request_options(params: Any, priority: Any, cache_salt: Any) -> None:
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
