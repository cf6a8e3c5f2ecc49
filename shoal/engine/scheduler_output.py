"""The hand-off between the scheduler and the model runner: plain data, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.engine.core_types import Logprobs
from shoal.kv_offload.plan import KVTransferPlan
from shoal.sampling_params import SamplingParams

# Input id of a token that a step still in flight samples (async scheduling); the model
# runner takes it from that step's sampled ids on the device.
PENDING_TOKEN = -1


@dataclass
class NewRequestData:
    """Sent the first time a request is scheduled, so the runner can set up its state."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]


@dataclass
class ScheduledRequest:
    request_id: str
    input_token_ids: list[int]  # tokens to run this step
    context_len: int  # tokens already in the KV cache before them
    block_ids: list[int]  # the whole block table
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    num_output_tokens: int  # outputs already generated (they are part of the context)

    @property
    def num_new_tokens(self) -> int:
        return len(self.input_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)  # decodes first
    num_decodes: int = 0
    new_requests: list[NewRequestData] = field(default_factory=list)
    # KV offloading: device <-> CPU-tier copies the runner queues before the forward pass;
    # ModelRunnerOutput.kv_transfers_done says when they have completed
    kv_transfers: KVTransferPlan | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    # prompt logprobs produced this step: request id -> [(position, logprobs), ...]
    prompt_logprobs: dict[str, list[tuple[int, Logprobs]]] = field(default_factory=dict)
    # requests whose logits were not finite: they are finished with an error
    failed_request_ids: set[str] = field(default_factory=set)
    # KV offloading: ids of the transfer plans whose copies have completed (the step's own
    # plan once its results are in; the scheduler then lets go of the plan's CPU slots)
    kv_transfers_done: list[int] = field(default_factory=list)
