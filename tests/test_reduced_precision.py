"""The near-tie comparison of a reduced-precision greedy run with the oracle's, on synthetic
logits: equal runs pass, a divergence passes only at a near tie, and a clear one fails."""

from __future__ import annotations

import pytest
import torch
from reduced_precision import BF16_TIE_MARGIN, assert_greedy_matches_up_to_a_near_tie


def _steps(*rows: dict[int, float]) -> list[torch.Tensor]:
    """One logits row of 8 tokens per step, -5 but where given."""
    out = []
    for row in rows:
        logits = torch.full((8,), -5.0)
        for tok, value in row.items():
            logits[tok] = value
        out.append(logits)
    return out


# The oracle picks 3, then 5 (with 6 within 0.1 of it, at a top logit of 20), then 1.
LOGITS = _steps({3: 20.0, 4: 16.0}, {5: 20.0, 6: 19.9, 2: 19.0}, {1: 12.0})
REF = [3, 5, 1]


def test_equal_runs_agree_throughout():
    assert assert_greedy_matches_up_to_a_near_tie(REF, REF, LOGITS) == 3


def test_a_divergence_at_a_near_tie_ends_the_comparison():
    # 6 is 0.1 below the top: a legitimate flip; what follows is not compared.
    assert assert_greedy_matches_up_to_a_near_tie([3, 6, 7], REF, LOGITS) == 1


@pytest.mark.parametrize("got", [[4, 5, 1], [3, 2, 1], [3, 5, 0]])
def test_a_divergence_with_a_clear_margin_fails(got):
    # 4 is 4 logits below the top, 2 is 1.0 (the bound is 20 / 32 = 0.625), 0 is 25.
    assert BF16_TIE_MARGIN * 20 == 0.625
    with pytest.raises(AssertionError, match="no near tie"):
        assert_greedy_matches_up_to_a_near_tie(got, REF, LOGITS)


def test_the_message_says_where_and_by_how_much():
    with pytest.raises(AssertionError) as err:
        assert_greedy_matches_up_to_a_near_tie([3, 2, 1], REF, LOGITS)
    msg = str(err.value)
    assert "token 1: got 2, oracle 5" in msg
    assert "1.0000 below its top 20.000 (top-2 margin 0.1000), bound 0.6250" in msg
    assert "largest |logit| 20.000" in msg


def test_the_bound_scales_with_the_largest_logit_magnitude_not_the_top():
    # A top of 4 among logits down to -40: the scale is 40, the bound 1.25, so 3 (1.0 below
    # the top) is a near tie; with the top as the scale (bound 0.125) it would not be.
    logits = _steps({2: 4.0, 3: 3.0, 0: -40.0})
    assert assert_greedy_matches_up_to_a_near_tie([3], [2], logits) == 0


def test_a_tighter_bound_refuses_the_same_flip():
    with pytest.raises(AssertionError, match="no near tie"):
        assert_greedy_matches_up_to_a_near_tie([3, 6, 7], REF, LOGITS, rel_margin=2**-8)


def test_lengths_and_the_oracles_argmax_are_checked():
    with pytest.raises(AssertionError):
        assert_greedy_matches_up_to_a_near_tie(REF[:2], REF, LOGITS)
    with pytest.raises(AssertionError, match="argmax"):
        assert_greedy_matches_up_to_a_near_tie([4, 5, 1], [4, 5, 1], LOGITS)
