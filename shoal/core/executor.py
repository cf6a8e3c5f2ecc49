"""The executor interface: what the engine core calls to run its steps, whoever runs them (the
model runner in the engine's process, its tensor/pipeline-parallel ranks over processes or
Ray actors, the pooling runner). Torch-free: the core never touches a tensor.

A step goes execute -> sample -> finish, as vLLM's execute_model / sample_tokens:

- execute(sched) queues the step's KV copies and forward pass and returns a handle at once;
- sample(handle, grammar) queues its sampling (or the verification of its drafts); the core
  fills the grammar bitmask of the step's structured rows on the host in between, while the
  device runs the forward pass (a step behind one still in flight is sampled once that one's
  tokens have reached the grammars);
- finish(handle) waits for the step's results and returns them as plain data.

Several steps may be between execute and finish at once: the core's queue of launched steps
has depth 1 (one step at a time), 2 (async scheduling) or the number of pipeline stages."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from shoal.core.kv_cache_spec import KVCacheLayout
from shoal.core.scheduler_output import GrammarBitmask, ModelRunnerOutput, SchedulerOutput
from shoal.lora_request import LoRARequest


class Executor(ABC):
    vocab_size: int
    # Seconds per start-up phase (load_model, profile_run, warmup, cuda_graphs, ...).
    startup_times: dict[str, float]
    # What a pooling model serves (shoal.pooling.model_info.PoolingInfo); None for generation.
    pooling_info: Any = None
    # LoRA: the adaptable projections and slots (shoal.lora.adapter.LoRALimits); None: off.
    lora_limits: Any = None

    @abstractmethod
    def initialize_kv_cache(self) -> KVCacheLayout:
        """Sizes and allocates the KV cache (and warms up, captures graphs); returns the
        device KV blocks the scheduler may hand out and the groups of layers sharing them."""

    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> Any:
        """Queues one step; returns its handle for sample() and finish()."""

    @abstractmethod
    def sample(self, handle: Any, grammar: GrammarBitmask | None) -> None:
        """Queues the step's sampling; grammar: what its structured rows may sample."""

    @abstractmethod
    def finish(self, handle: Any) -> ModelRunnerOutput:
        """Waits for the step and returns its results (its KV copies reported as done)."""

    @abstractmethod
    def remove_requests(self, serials: set[int]) -> None:
        """Drops the per-request state of requests that ended."""

    @abstractmethod
    def reset_after_fault(self) -> None:
        """A step raised: forgets what steps in flight left behind (raises if the device
        itself is broken, which ends the engine)."""

    @abstractmethod
    def check_health(self) -> None:
        """Runs a step of one made-up token (forward pass and sampling, no request's state
        touched); raises if the device or the model cannot. After steps keep failing, this
        tells a broken engine from requests at fault."""

    def collective_rpc(self, method: str, args: list[Any]) -> list[Any]:
        """Runs a named lifecycle method (shoal/worker/lifecycle.py: sleep, wake_up, weight
        updates, ...) on every rank; returns each rank's result, rank 0 first."""
        raise NotImplementedError(f"{type(self).__name__} runs no lifecycle methods")

    # LoRA adapters, on every rank (engine/core_lora.py calls these only with enable_lora on)
    def add_lora(self, lora: LoRARequest) -> bool:
        """Reads the adapter ahead of requests; ValueError naming it when it cannot serve."""
        raise ValueError(f"{type(self).__name__} serves no LoRA adapters")

    def remove_lora(self, lora_id: int) -> bool:
        """Forgets an adapter (a later request reads it again); False when not loaded."""
        return False

    def pin_lora(self, lora_id: int) -> bool:
        """Keeps a loaded adapter in host memory and in its device slot until removed."""
        raise ValueError(f"{type(self).__name__} serves no LoRA adapters")

    def list_loras(self) -> set[int]:
        """The ids of the adapters loaded (host memory or a device slot)."""
        return set()

    def shutdown(self) -> None:
        """Stops worker ranks and leaves process groups (idempotent)."""
        return None

    @property
    def num_forwards(self) -> int:
        """Steps launched with a forward pass (DP+EP lockstep counts them)."""
        return 0

    def run_dummy_batch(self) -> None:
        """DP+EP: a forward pass of one made-up token, so that a replica with nothing to run
        still joins the MoE layers' collectives of a step the other replicas run."""
        raise NotImplementedError(f"{type(self).__name__} runs no dummy batches")

    def lockstep_drafts(self, agree: Any) -> None:
        """DP+EP: `agree` (a replica's bid -> the largest of any replica) keeps a drafter whose
        experts are split over the replicas in step with the others (worker/draft_lockstep.py);
        an executor without such a drafter ignores it."""
        return None

    def lockstep_loras(self, agree: Any) -> None:
        """DP+EP: `agree` (as lockstep_drafts') lets the MoE experts' LoRA slots, one table
        over the replicas, skip exchanging the adapters of a step where no replica's changed
        (lora/shared_expert_slots.py); an executor without them ignores it."""
        return None

    def pad_draft_passes(self) -> None:
        """DP+EP, after each step: the drafter's dummy passes up to the agreed count."""
        return None

    def kv_cache_tensors(self) -> list[Any]:
        """The device KV cache tensors, one per paged layer (KV offloading copies them)."""
        return []

    def use_kv_transfer(self, transfer: Any) -> None:
        """KV offloading: the device <-> CPU-tier copier that runs each step's plan."""
        raise ValueError(f"{type(self).__name__} does not support KV offloading")
