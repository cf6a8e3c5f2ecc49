"""Messages between the frontend and the engine core (msgspec structs: they cross a process
boundary as msgpack, never pickle).

The per-token structs are not tracked by the cyclic garbage collector (gc=False: they hold
only numbers, strings and lists of them, so they cannot form cycles): hundreds arrive every
step, and tracking them made the frontend's collector run several times a step."""

from __future__ import annotations

from typing import Any

import msgspec

from shoal.core.errors import ErrorCode
from shoal.lora_request import LoRARequest
from shoal.multimodal.inputs import MultiModalFeature
from shoal.pooling_params import PoolingParams
from shoal.sampling_params import SamplingParams


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    pooling_params: PoolingParams | None = None  # set: a pooling request (pooling engines)
    token_type_ids: list[int] | None = None  # BERT segment ids of a cross-encoder pair
    lora: LoRARequest | None = None  # the LoRA adapter it runs with
    # its images, in prompt order (placeholders already expanded in prompt_token_ids)
    mm_features: list[MultiModalFeature] | None = None
    # The data-parallel replica the client asked for (vLLM's X-data-parallel-rank; a cache-
    # aware router names the one holding the prefix); None: the DP client balances by load.
    data_parallel_rank: int | None = None


class Logprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of one position: token_ids[0] is the chosen token, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None = None
    # (position, logprobs) pairs for prompt positions computed this step
    prompt_logprobs: list[tuple[int, Logprobs]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # set with finish_reason "error": what went wrong, for people
    queue_time: float | None = None  # arrival -> first scheduling, on the first sampled output
    # A pooling request's result: float32 bytes (little-endian, C order) of this shape.
    pooled: bytes | None = None
    pooled_shape: list[int] | None = None
    # Disaggregated prefill: where the request's KV waits for a decode engine (its last output)
    kv_transfer_params: dict[str, Any] | None = None
    # finish_reason "stop" on the last token being EOS or a stop_token_id (not a grammar
    # that completed on another token): the text leaves that token out (vLLM's)
    stop_token: bool = False
    # Why the request failed, beside `error` (the frontends answer from the code, never from
    # the text); an error without a code counts as ErrorCode.ENGINE_FAILED. Kept last. Unset,
    # it, stop_token and kv_transfer_params cost a byte each: msgspec writes every field of
    # an array-like struct (omit_defaults drops defaults from map-encoded structs only).
    error_code: ErrorCode | None = None


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    # Of num_waiting, those deferred by a transient constraint (a KV load from a slower tier)
    # rather than by capacity; 0 until the scheduler reports it.
    num_waiting_deferred: int = 0
    # Secondary KV tiers (cpu, disk), cumulative since start-up: tier -> field -> value, with
    # the fields of shoal.kv_offload.stats.TierStats plus "usage". None without offloading.
    kv_tiers: dict[str, dict[str, float]] | None = None
    # Speculative decoding in this interval (vLLM's spec_decode_* counters): verified drafts,
    # their tokens, the accepted ones, and the accepted ones by draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] | None = None
    # ...and by draft position, the drafts that reached a decode step (proposed) and those
    # scheduled for verification (verified): proposed >= verified >= accepted.
    spec_num_proposed_tokens_per_pos: list[int] | None = None
    spec_num_verified_tokens_per_pos: list[int] | None = None
    # Linear-attention models: blocks of the pool holding recurrent states now (each a
    # state of every layer of one state group), and a request's state bytes (all layers).
    num_state_blocks: int = 0
    state_bytes_per_request: int = 0
    # LoRA (enable_lora): the adapters of the running and the waiting requests, by name,
    # and the slots a step has (vLLM's lora_requests_info); None without LoRA.
    running_loras: list[str] | None = None
    waiting_loras: list[str] | None = None
    max_loras: int = 0
    # Images (cumulative since start-up): images encoded, images whose encoder output was
    # in the cache already (the same image again, or a chunk after the one that encoded it)
    mm_items_encoded: int = 0
    mm_cache_hits: int = 0


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    stats: SchedulerStats | None = None
