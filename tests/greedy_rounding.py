"""Two greedy runs (kv_fp8_helpers.GreedyRun) that compute the same thing in float32 through
different kernels (an FP8 cache's against an "auto" cache holding the same rounded rows, CUDA
graphs of Triton kernels against the eager torch path): they agree up to float32 rounding.

Where exact equality holds by construction (the CPU's torch paths) a test asserts it; where
only rounding separates the runs, this asserts what must still hold. While both runs share
their context (each step up to and including the first divergence), each step's logprobs
agree within `atol` over the whole vocabulary. The tokens may part only at a near tie: two
rows within atol of each other can swap a token only where the reference's logprob of it was
within 2 atol of its top, and the check of the rows already implies that; the token check
says so in its own message. After a divergence the runs' contexts differ and nothing later
is compared."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kv_fp8_helpers import GreedyRun


@dataclass
class RoundingAgreement:
    max_logprob_diff: float  # over every compared step and token id
    compared: int  # steps compared
    agreeing: list[int]  # per prompt: leading tokens equal

    def describe(self) -> str:
        return (f"max |logprob difference| {self.max_logprob_diff:.3g} over {self.compared} "
                f"steps; leading tokens equal per prompt {self.agreeing}")


def assert_same_run_up_to_rounding(got: GreedyRun, want: GreedyRun, atol: float,
                                   what: str = "") -> RoundingAgreement:
    """Asserts `got` follows `want` (the reference) as described above; `what` names the runs
    in the messages. Returns how far they agreed."""
    if not atol > 0:
        raise ValueError(f"atol must be > 0, got {atol}")
    if len(got.tokens) != len(want.tokens):
        raise ValueError(f"{len(got.tokens)} prompts against {len(want.tokens)}")
    worst, compared, agreeing = 0.0, 0, []
    for p, (toks, ref, rows, ref_rows) in enumerate(
            zip(got.tokens, want.tokens, got.logits, want.logits, strict=True)):
        assert len(toks) == len(ref) == len(rows) == len(ref_rows), (
            f"{what} prompt {p}: {len(toks)} tokens, {len(rows)} logit rows against "
            f"{len(ref)} and {len(ref_rows)}")
        n = len(ref)
        for i, (g, r, row, ref_row) in enumerate(zip(toks, ref, rows, ref_rows)):
            a = torch.log_softmax(row.float(), -1)
            b = torch.log_softmax(ref_row.float(), -1)
            diff = (a - b).abs()
            at = int(diff.argmax())
            worst, compared = max(worst, float(diff[at])), compared + 1
            assert float(diff[at]) <= atol, (
                f"{what} prompt {p}, token {i}: logprobs {float(diff[at]):.3g} apart (token "
                f"id {at}: {float(a[at]):.5f} against {float(b[at]):.5f}), more than the "
                f"rounding's {atol:g}; tokens before {i} agree:\ngot {toks}\nref {ref}")
            if g != r:
                gap = float(b[r] - b[g])
                assert gap <= 2 * atol, (
                    f"{what} prompt {p}, token {i}: got {g}, reference {r}, and no near tie "
                    f"there: the reference's logprob of {g} is {gap:.3g} below its top (bound "
                    f"2 x {atol:g})\ngot {toks}\nref {ref}")
                n = i
                break
        agreeing.append(n)
    return RoundingAgreement(worst, compared, agreeing)
