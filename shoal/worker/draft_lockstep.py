"""DP+EP: a drafter whose MoE experts are split over the replicas runs the same sequence of
forward passes on every replica, every step.

Why: under DP+EP (shoal/engine/dp_lockstep.py) every MoE layer exchanges tokens all-to-all
between the replicas (shoal/layers/moe/all_to_all.py), a collective matched by call order. The
target already agrees: every replica runs one forward pass per step, a dummy one when it has
nothing to run. A drafter built on the same expert split (a draft model, the MTP layers of a
DeepSeek or Qwen3-Next target) runs a number of passes that depends on the replica's own
requests: none when idle, a mirror only when no request samples, fewer drafts near
max_model_len. A replica that drafts while another does not would wait in the all-to-all
forever, and a pass of MTP layer 1 that meets another replica's pass of layer 0 would send
its tokens to the wrong experts. Drafters without such layers (ngram, EAGLE heads, a dense
draft model) draft on their own and need none of this.

So the passes of one step follow a canonical sequence (PassPlan): the mirror's (depths 0..n-1
of a hidden-state head, the one pass of a draft model), then the drafting passes (depths
1..n-1, then the last depth over and over; a draft model's k steps). Whatever a replica runs
is a subsequence of it. The replicas agree on how many entries a step runs (one all-reduce,
max, over their coordination group): a replica bids the whole sequence right before its
first pass of the step, or nothing at the end of a step without one (a replica with no
forward pass, or whose requests gave the drafter nothing to do). Before each real pass the
replica runs a dummy pass (one made-up token into a scratch block) for every entry it
skipped; at the end of the step, for the rest up to the agreed count. So a step drafts in
lockstep when any replica drafts, and runs no drafter pass when none does; a step where
some replica only mirrors (prefill chunks) and none drafts runs the drafting passes as
dummies (the price of bidding at the first pass, where the drafter calls it, rather than
from every drafter's own plan). The adaptive draft budget stays per replica; only the pass
count is shared.

ModelRunner takes the Executor side (lockstep_drafts, pad_draft_passes) from
RunnerDraftLockstep; engine/dp_lockstep.py calls them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

# A replica's bid -> the largest bid of any replica (every replica calls it at one point)
AgreeMax = Callable[[int], int]


@dataclass(frozen=True)
class PassPlan:
    """The most passes of a drafter's model one target step runs: `mirror` passes over the
    step's tokens (kinds 0..mirror-1: a head's depths), then `drafting` greedy passes (kinds
    1..mirror-1, then mirror-1 repeated; with one kind, all 0)."""

    mirror: int
    drafting: int

    def __post_init__(self) -> None:
        if self.mirror < 1 or self.drafting < 0:
            raise ValueError(f"PassPlan needs mirror >= 1 and drafting >= 0 (got {self})")

    def kind(self, i: int) -> int:
        """Which depth the i-th pass of a step runs."""
        if i < self.mirror:
            return i
        return min(i - self.mirror + 1, self.mirror - 1)

    @property
    def length(self) -> int:
        return self.mirror + self.drafting


def dispatches_tokens(model: nn.Module) -> bool:
    """Whether some MoE layer of `model` exchanges tokens with the other replicas."""
    return any(getattr(m, "dispatch_group", None) is not None for m in model.modules())


class DraftPassLockstep:
    """One replica's side of the agreement for a drafter's model (see the module docstring).
    dummy_pass(kind) runs one made-up token through depth `kind` of the model."""

    def __init__(self, model: nn.Module, plan: PassPlan, dummy_pass: Callable[[int], None],
                 agree: AgreeMax):
        self.plan, self.dummy_pass, self.agree = plan, dummy_pass, agree
        self.agreed: int | None = None  # entries the current step runs (None: between steps)
        self.ran = 0  # entries run so far this step, real or dummy
        self.dummy_passes = 0  # passes run for the other replicas' sake, in all
        self._padding = False
        model.register_forward_pre_hook(self._before_pass, with_kwargs=True)

    def end_step(self) -> None:
        """After every step (a replica that ran no pass bids here): the dummy passes that
        take it to the agreed count."""
        if self.agreed is None:
            self._agree(0)
        assert self.agreed is not None
        while self.ran < self.agreed:
            self._dummy()
        self.agreed = None

    def _agree(self, bid: int) -> None:
        self.agreed, self.ran = self.agree(bid), 0

    def _before_pass(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if self._padding:
            return
        if self.agreed is None:  # the step's first pass
            self._agree(self.plan.length)
        kind = int(kwargs.get("depth", 0))
        while self.ran < self.agreed and self.plan.kind(self.ran) != kind:
            self._dummy()
        if self.ran >= self.agreed:
            raise RuntimeError(f"DP+EP: a drafter pass of depth {kind} past the {self.agreed} "
                               f"passes the replicas agreed on ({self.plan})")
        self.ran += 1

    def _dummy(self) -> None:
        self._padding = True
        try:
            self.dummy_pass(self.plan.kind(self.ran))
        finally:
            self._padding = False
        self.ran += 1
        self.dummy_passes += 1


def drafter_lockstep(drafter: Any, agree: AgreeMax) -> DraftPassLockstep | None:
    """The lockstep of a drafter whose model dispatches tokens over the replicas (a
    DrafterCache: pass_plan, dummy_pass); None for any other (nothing to agree on)."""
    model = getattr(drafter, "model", None)
    if not isinstance(model, nn.Module) or not dispatches_tokens(model):
        return None
    return DraftPassLockstep(model, drafter.pass_plan(), drafter.dummy_pass, agree)


class RunnerDraftLockstep:
    """The Executor methods of DP+EP's drafter lockstep, for ModelRunner (its `drafter`)."""

    drafter: Any
    draft_lockstep: DraftPassLockstep | None = None

    def lockstep_drafts(self, agree: AgreeMax) -> None:
        """`agree`: the replicas' all-reduce (max) of engine/dp_lockstep.py."""
        if self.drafter is not None:
            self.draft_lockstep = drafter_lockstep(self.drafter, agree)

    def pad_draft_passes(self) -> None:
        """After each step: the drafter's dummy passes up to the agreed count."""
        if self.draft_lockstep is not None:
            self.draft_lockstep.end_step()
