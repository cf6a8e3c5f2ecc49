"""The hand-off between the scheduler and the model runner: plain data, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shoal.core.kv_connector_plan import KVConnectorPlan
from shoal.core.kv_transfer_plan import KVTransferPlan
from shoal.core.types import Logprobs
from shoal.lora_request import LoRARequest
from shoal.multimodal.inputs import MultiModalFeature
from shoal.pooling_params import PoolingParams
from shoal.sampling_params import SamplingParams

# Input id of a token that a step still in flight samples (async scheduling); the model
# runner takes it from that step's sampled ids on the device.
PENDING_TOKEN = -1


@dataclass
class NewRequestData:
    """Sent the first time a request is scheduled (and again after a fault dropped the
    runner's state of it), so the runner can set up its state."""

    request_id: str
    serial: int  # the scheduler's own number for this request: results are matched on it
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    output_token_ids: list[int] = field(default_factory=list)  # produced before a fault
    pooling_params: PoolingParams | None = None  # a pooling request (pooling engines only)
    token_type_ids: list[int] | None = None  # BERT segment ids of a (query, document) pair
    lora: LoRARequest | None = None  # its LoRA adapter
    mm_features: list[MultiModalFeature] | None = None  # its images


@dataclass
class ScheduledRequest:
    request_id: str
    # Unique per request for the engine's lifetime, unlike the caller's id: a result of a
    # step still in flight is matched on it, so an id reused meanwhile never takes it.
    serial: int
    input_token_ids: list[int]  # tokens to run this step
    context_len: int  # tokens already in the KV cache before them
    block_ids: list[int]  # the whole block table (of the first KV cache group)
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    num_output_tokens: int  # outputs already generated (they are part of the context)
    # Speculative decoding: the last this-many input tokens are drafts to verify (the
    # runner samples every one of the k+1 positions and keeps the accepted run)
    num_draft_tokens: int = 0
    # The tables of the other KV cache groups (shoal/core/kv_cache_spec.py), one per group;
    # empty for a model whose layers all keep their cache alike
    group_block_ids: tuple[list[int], ...] = ()
    # Linear-attention layers after a verify step: its first this-many tokens (the accepted
    # run) are folded into the recurrent states before this step's tokens (ReplaySSM)
    replay: int = 0
    # Speculative decoding: no drafts of this step's finish are wanted (engine/draft_budget.py
    # drafts_paused: the request backs off past its next step, or this verify step backs it
    # off if it accepts nothing), so a drafter may keep its rows and catch up when drafting
    # resumes; a marked verify step that does accept drafts is mirrored and drafted from
    drafts_paused: bool = False
    # Speculative decoding: the drafts the request's next step can verify at most, per
    # outcome of this one (index: drafts it accepts; one entry when it verifies none), as
    # the adaptive budget will count (engine/draft_budget.py draft_limits); a drafter drafts
    # no deeper, and keeps the rows of a request whose limit is 0 as a paused one's. Empty:
    # no limit known (a prompt chunk, a request backing off, the budget not adaptive).
    draft_limits: tuple[int, ...] = ()

    @property
    def num_new_tokens(self) -> int:
        return len(self.input_token_ids)


@dataclass
class GrammarBitmask:
    """What the structured rows of a step may sample, filled by the engine core on the host
    while the device runs the step's forward pass (Executor.sample). Row i of `bitmask` (an
    int32 host array [rows, ceil(vocab / 32)], bit j of word w allowing token 32 * w + j) is
    for the request with serials[i]; in a step that verifies drafts a request has one row per
    position (its drafts + 1), in order."""

    serials: list[int]
    bitmask: Any


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes first
    num_decodes: int = 0
    new_requests: list[NewRequestData] = field(default_factory=list)
    # KV offloading: device <-> CPU-tier copies the runner queues before the forward pass;
    # ModelRunnerOutput.kv_transfers_done says when they have completed
    kv_transfers: KVTransferPlan | None = None
    # (block id, first slot): KV slots the runner zeroes before anything else this step,
    # left by a request that produced non-finite values (see engine/failed_blocks.py)
    kv_zero: list[tuple[int, int]] = field(default_factory=list)
    # Images (shoal/engine/encoder_schedule.py): the encoder cache entries the runner drops
    # first, then the (request serial, feature index) whose encoder outputs it computes and
    # keeps before this step's forward pass reads them
    encoder_free: list[str] = field(default_factory=list)
    encoder_inputs: list[tuple[int, int]] = field(default_factory=list)
    # Prefill/decode disaggregation: another engine's KV to write before the forward pass,
    # finished prompts' KV to read out after it (shoal/kv_transfer)
    kv_connector: KVConnectorPlan | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def has_drafts(self) -> bool:
        """A verify step: the next step's inputs wait for its accepted drafts."""
        return any(s.num_draft_tokens for s in self.scheduled)


@dataclass
class ModelRunnerOutput:
    """A step's results, keyed by request serial (ScheduledRequest.serial)."""

    sampled_token_ids: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, Logprobs] = field(default_factory=dict)
    # Speculative decoding. A verified request's tokens this step (the accepted drafts, then
    # one sampled token) and their logprobs; its sampled_token_ids entry is the first of them.
    verified_token_ids: dict[int, list[int]] = field(default_factory=dict)
    verified_logprobs: dict[int, list[Logprobs]] = field(default_factory=dict)
    # Drafts proposed for each request that sampled, for the next step to verify.
    draft_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # ...and the drafter's probability of each (softmax at the drafted token), where the
    # drafter has them and confidence-scheduled verification is on (draft_budget.py).
    draft_probs: dict[int, list[float]] = field(default_factory=dict)
    # prompt logprobs produced this step: serial -> [(position, logprobs), ...]
    prompt_logprobs: dict[int, list[tuple[int, Logprobs]]] = field(default_factory=dict)
    # requests whose logits were not finite: they are finished with an error
    failed_serials: set[int] = field(default_factory=set)
    # requests the step could not run as asked, with why (DP+EP: a LoRA adapter a replica
    # could not load, lora/slots.py): they are finished with that error
    failed_errors: dict[int, str] = field(default_factory=dict)
    # KV offloading: ids of the transfer plans whose copies have completed (the step's own
    # plan once its results are in; the scheduler then lets go of the plan's CPU slots)
    kv_transfers_done: list[int] = field(default_factory=list)
    # pooling engines: each finished request's result (a float32 numpy array)
    pooled: dict[int, Any] = field(default_factory=dict)
    # the KV rows read out for the step's KVSaves (kv_transfer KVPayload), by their key
    kv_saved: dict[str, Any] = field(default_factory=dict)
