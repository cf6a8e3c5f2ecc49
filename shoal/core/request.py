"""The engine core's view of one request: token ids and progress, no text."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from shoal.lora_request import LoRARequest
from shoal.multimodal.inputs import MultiModalFeature
from shoal.pooling_params import PoolingParams
from shoal.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int  # resolved against max_model_len
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is computed or being computed
    # Tokens sampled by a step still in flight (async scheduling): counted for scheduling,
    # their ids arrive with that step's results.
    num_pending_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 = not yet scheduled
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # Ended on a stop token (EOS or a stop_token_id, by check_stop or by a grammar that
    # accepted EOS): its text is left out of the output (vLLM's)
    stopped_on_token: bool = False
    first_scheduled_time: float | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    # The scheduler's number for this request, unique for the engine's lifetime (results of
    # steps in flight are matched on it, never on the caller's id, which may be reused).
    serial: int = 0
    # Steps that raised while running this request (engine/suspects.py); a suspect runs
    # alone until it has produced a token again.
    num_faults: int = 0
    suspect: bool = False
    # Speculative decoding: draft tokens proposed after the last step, verified by the next;
    # verify steps in a row that accepted nothing, decode steps left to run without drafts
    # (the backoff that follows: draft_budget.py) and backoffs since the last acceptance.
    spec_token_ids: list[int] = field(default_factory=list)
    # The drafter's probability of each of them (empty: none known, taken as 1.0).
    spec_probs: list[float] = field(default_factory=list)
    # The accepted run of its last verify step, not yet in linear-attention states (see
    # ScheduledRequest.replay)
    state_replay: int = 0
    # Backoff (draft_budget.py): steps in a row whose drafts were all rejected or skipped
    # for low confidence, decode steps left without drafts, pauses so far, and whether any
    # of its drafts was ever accepted
    spec_misses: int = 0
    spec_skip: int = 0
    spec_backoffs: int = 0
    spec_ever_accepted: bool = False
    # Decayed counts of accepted drafts and of first rejections (the adaptive budget's
    # estimate, draft_budget.py); they start at its prior.
    spec_hits: float = 3.0
    spec_fails: float = 0.0
    # Per outcome of the step being scheduled, the drafts its next step can verify at most
    # (ScheduledRequest.draft_limits; empty: no limit known)
    spec_draft_limits: tuple[int, ...] = ()
    # A pooling request (pooling engines): one forward, then its pooled result.
    pooling_params: PoolingParams | None = None
    token_type_ids: list[int] | None = None
    # The request's grammar (shoal.structured_output.manager.StructuredRequest) when its
    # output is constrained; the scheduler only asks it whether it is ready and feeds it tokens.
    structured: Any = None
    lora: LoRARequest | None = None  # its LoRA adapter (None: the base model)
    mm_features: list[MultiModalFeature] | None = None  # its images, in prompt order

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def hash_extra(self) -> str | None:
        """What the prefix-cache hash mixes into its first block: the cache salt and the
        adapter (a request without an adapter hashes its salt alone, as before adapters)."""
        if self.lora is None:
            return self.cache_salt
        return f"{self.cache_salt or ''}\x00{self.lora.cache_key}"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        """Known tokens plus the ones a step in flight will produce."""
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)
