"""DP+EP: a drafter's passes padded to the canonical sequence the replicas agreed on
(shoal/worker/draft_lockstep.py), whatever subsequence of it this replica runs itself. The
replicas' end of it (two gloo processes, MoE drafters) is in
tests/spec_decode/test_spec_dp_expert_parallel.py."""

from __future__ import annotations

import pytest
from torch import nn

from shoal.worker.draft_lockstep import DraftPassLockstep, PassPlan

CHAIN = PassPlan(mirror=3, drafting=3)  # three MTP depths: mirror 0 1 2, drafts 1 2 2
CANONICAL = [0, 1, 2, 1, 2, 2]


class Passes(nn.Module):
    """A drafter model that logs the depth of every pass, real or dummy."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[int] = []

    def forward(self, x: object, depth: int = 0) -> None:
        self.log.append(depth)


def _step(plan: PassPlan, real: list[int], other_bid: int) -> tuple[list[int], list[int], int]:
    """One step of a replica whose drafter runs `real` beside one bidding other_bid: (every
    pass run, this replica's bids, its dummy passes)."""
    model = Passes()
    bids: list[int] = []

    def agree(bid: int) -> int:
        bids.append(bid)
        return max(bid, other_bid)

    lockstep = DraftPassLockstep(model, plan, lambda d: model(None, depth=d), agree)
    for depth in real:
        model(None, depth=depth) if depth else model(None)
    lockstep.end_step()
    return model.log, bids, lockstep.dummy_passes


@pytest.mark.parametrize("real, other, dummies", [
    ([], 6, 6),  # idle (or nothing to draft from): every pass of the other's as a dummy
    ([0, 1, 1, 2], 6, 2),  # the mirror skips depth 2 (no carry), then 2 drafts
    ([0, 1, 2, 1], 0, 2),  # drafts cut near max_model_len; the other replica idle
    ([0, 1, 2], 0, 3),  # a mirror only (prefill chunks) while nobody drafts: bid in full
    (CANONICAL, 0, 0),  # the longest: no dummy
])
def test_every_replica_runs_the_agreed_canonical_passes(real, other, dummies):
    log, bids, dummy = _step(CHAIN, real, other)
    assert log == CANONICAL
    assert bids == [CHAIN.length if real else 0]  # at its first pass, or after the step
    assert dummy == dummies


def test_a_draft_model_mirrors_once_then_drafts_k():
    plan = PassPlan(mirror=1, drafting=3)  # one kind: any count pads at the end
    assert [plan.kind(i) for i in range(4)] == [0, 0, 0, 0]
    assert _step(plan, [0], 0) == ([0] * 4, [4], 3)
    assert _step(plan, [], 0) == ([], [0], 0)  # nobody drafts: no pass at all


def test_passes_off_the_sequence_raise():
    plan = PassPlan(mirror=2, drafting=1)  # 0 1 1
    with pytest.raises(RuntimeError, match="past the 3 passes"):
        _step(plan, [0, 1, 1, 1], 0)
    with pytest.raises(RuntimeError, match="past the 3 passes"):
        _step(plan, [1, 0], 0)  # depth 0 after depth 1: not in the sequence any more
    with pytest.raises(ValueError, match="mirror >= 1"):
        PassPlan(mirror=0, drafting=2)
