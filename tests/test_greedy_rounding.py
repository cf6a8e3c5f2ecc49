"""greedy_rounding.assert_same_run_up_to_rounding on made-up runs: what it lets through (rows
within the rounding, a swap at a near tie, anything after it) and what it stops (rows apart,
a swap without a near tie), with messages that say where and by how much."""

from __future__ import annotations

import pytest
import torch
from greedy_rounding import assert_same_run_up_to_rounding
from kv_fp8_helpers import GreedyRun


def _run(rows: list[list[torch.Tensor]]) -> GreedyRun:
    """Greedy tokens of logits rows (per prompt, per step)."""
    return GreedyRun([[int(r.argmax()) for r in p] for p in rows], rows)


def _reference() -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [[torch.randn(64, generator=gen) * 3 for _ in range(n)] for n in (5, 4)]


def test_rows_within_the_rounding_agree_everywhere():
    ref = _reference()
    gen = torch.Generator().manual_seed(1)
    moved = [[r + 1e-4 * torch.randn(64, generator=gen) for r in p] for p in ref]
    agreed = assert_same_run_up_to_rounding(_run(moved), _run(ref), 1e-3)
    assert agreed.agreeing == [5, 4] and agreed.compared == 9
    assert 0 < agreed.max_logprob_diff <= 1e-3


def test_a_swap_at_a_near_tie_ends_the_comparison():
    ref = _reference()
    top = int(ref[0][2].argmax())
    second = int(ref[0][2].topk(2).indices[1])
    ref[0][2][second] = ref[0][2][top] - 2e-4  # a near tie at step 2 of prompt 0
    got = [[r.clone() for r in p] for p in ref]
    got[0][2][second] += 4e-4  # within 1e-3: the other token wins
    got[0][3] += torch.arange(64.0)  # after the divergence: another context, not compared
    agreed = assert_same_run_up_to_rounding(_run(got), _run(ref), 1e-3)
    assert agreed.agreeing == [2, 4] and agreed.compared == 3 + 4


def test_rows_apart_fail_naming_the_step_and_the_size():
    ref = _reference()
    got = [[r.clone() for r in p] for p in ref]
    got[1][1][7] += 0.5
    with pytest.raises(AssertionError, match=r"prompt 1, token 1: logprobs 0\.[45]\d* apart "
                                             r"\(token id 7"):
        assert_same_run_up_to_rounding(_run(got), _run(ref), 1e-3)


def test_a_token_other_than_its_rows_choice_fails_without_a_near_tie():
    """(The rows agree, but the run's token is not what they give: a recording or sampling
    slip.)"""
    ref = _reference()
    got = _run([[r.clone() for r in p] for p in ref])
    want = _run(ref)
    got.tokens[0][1] = int(ref[0][1].argmin())
    with pytest.raises(AssertionError, match="prompt 0, token 1: got .* no near tie"):
        assert_same_run_up_to_rounding(got, want, 1e-3)
    with pytest.raises(ValueError, match="atol must be > 0"):
        assert_same_run_up_to_rounding(want, want, 0.0)
