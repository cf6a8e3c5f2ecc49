"""The interface the model runner drafts through (speculative decoding). Implementations live
in shoal/spec_decode/ (ngram, a draft model, the hidden-state heads of MTP and EAGLE, the
test-only forced acceptance) and are built by its factory, which the executor hands the
runner: the runner never knows which one it holds.

Per target step: on_launch(step) right after the target's forward pass is queued (a drafter
with a KV cache of its own mirrors the step into it there, or keeps what it needs for
later); propose(step, state, out, latest) once the step's tokens have been read, which puts
the drafts of each request that sampled into out.draft_token_ids for the next step to
verify.

Tensor parallelism: every rank builds its drafter under the target's TP group, so a draft
model's and a head's layers are sharded as the target's (each rank's drafter KV cache holds
its share of the KV heads, sized beside the target's per rank), and the heads share the
target's vocab-parallel embedding and LM head (replicas would hold a whole LM head each).
Every rank runs the same drafting passes, kept in lockstep by their all-reduces, over the
same tokens: the sampled and accepted tokens of rank 0 are every rank's (ModelRunner.sample
broadcasts them; a grammar's mask is applied on rank 0 only, unseeded sampling differs per
process). Only rank 0's drafts reach the scheduler, which sends every rank the drafts to
verify with the step; host drafters (ngram) therefore draft on rank 0 only.

Pipeline parallelism: stage 0 drafts (the later stages build no drafter). It holds the
embedding and the LM head and samples from the final hidden states the last stage sends back
(worker/stage_link.py), so a drafter that reads them gets the step's on_launch only once the
step is sampled, right before propose; a draft model mirrors at launch as usual. Micro-batches
never share a request, so a step finished behind a later one still proposes (latest=True)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from shoal.core.scheduler_output import ModelRunnerOutput
from shoal.worker.step_inputs import StepInputs


@dataclass
class TargetStep:
    """What a drafter sees of one target step."""

    inputs: StepInputs
    # every token's final hidden state (keeps_hidden drafters; pipeline stage 0: once sampled)
    hidden: torch.Tensor | None
    input_ids: Callable[[], torch.Tensor]  # the step's ids on the device, pending filled in
    hidden_static: bool = False  # hidden is a CUDA graph's output: the next replay overwrites it
    # pipeline stage 0, once sampled: every stage's EAGLE-3 aux states (stage_link.py)
    aux: torch.Tensor | None = None
    # a verify graph's padded row of each real token, where it wrote the target's other
    # per-token buffers (EAGLE-3's aux_buffer); None: in order, first (ForwardOutput.rows)
    rows: torch.Tensor | None = None


class Drafter(ABC):
    k: int  # drafts proposed per request and step (at most)
    # The target's CUDA graphs keep every token's hidden states for this drafter.
    keeps_hidden: bool = False

    def kv_layers(self) -> list[Any]:
        """Attention layers whose paged KV cache is the drafter's: on the target's block
        tables, so the KV pool's size counts them (none: a drafter without layers)."""
        return []

    def bind(self, num_blocks: int, backend: Any) -> None:
        """Allocates the drafter's cache over the target's num_blocks blocks."""
        return None

    def capture_graphs(self, pool: Any, max_blocks: int) -> float:
        """Captures the drafting steps as CUDA graphs (after bind); returns seconds taken."""
        return 0.0

    def on_launch(self, step: TargetStep) -> Any:
        """The target's forward pass is queued: mirror it, or keep what propose() needs;
        returns that per-step state."""
        return None

    @abstractmethod
    def propose(self, step: TargetStep, state: Any, out: ModelRunnerOutput,
                latest: bool) -> None:
        """The step's tokens are in out (and in each request's state): drafts for the
        requests that sampled into out.draft_token_ids. latest=False: a later step has been
        launched already and verifies no drafts, so a drafter that pays for its proposals
        may only mirror (the scheduler reads whether host proposers found any)."""

    def accept_mask(self, drafts_per_request: list[int]) -> list[bool] | None:
        """Test-only forced acceptance: whether each verify row's draft counts as accepted
        (None: the target's distribution decides, the only lossless choice)."""
        return None


# (engine config, target model, its LoadedModel) -> the drafter of the speculative config
DrafterFactory = Callable[[Any, torch.nn.Module, Any], Drafter | None]
