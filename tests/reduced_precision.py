"""Comparing a reduced-precision greedy run (bfloat16, or int4 weights with bfloat16
activations) with the float32 oracle's: the same tokens, except where the oracle's top two
logits are so close that rounding may legitimately swap them.

Such a near tie is decided by the CPU's kernels (their accumulation order, AMX or AVX-512
BF16 or none): one host's run follows the oracle there and another's does not. After the
first divergence the two runs continue from different contexts, so nothing later is compared.
"""

from __future__ import annotations

import torch

# How close two logits may be for a bfloat16 run to pick either, relative to the scale of
# the oracle's logits at that step (the row's largest |logit|). bfloat16 keeps 8 significant
# bits: each rounding moves a value by up to 2^-8 of its size, and the roundings of the
# hidden state in every layer move each logit (its dot product with a token's embedding) by
# a few such steps of the products' size. The row's largest |logit| tracks that size; its
# top logit does not (a step with a small top has large negative logits, and there the
# errors relative to the top were largest).
# Measured on SmolLM2-135M against transformers in float32 (720 steps of 15 prompts,
# teacher-forced on shoal's tokens, on a 2-core AMD Zen 4 with AVX-512 BF16), the error of
# the top-1 minus top-2 margin reached 4.2 such units (0.35 logits; p99 2.5, median 0.6) in
# bfloat16 (the default: int4 weights for steps of a few tokens), 2.6 (0.29 logits) with
# int4 weights and bfloat16 activations only; with torch and oneDNN held to AVX2 (as on a
# Zen 3: ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2) 4.2 (0.41 logits) and 2.6.
# The flip seen on an Intel AMX host (chat prompt, token 15, margin 0.376 at a largest
# |logit| of 18.5) needed 5.2. 8 units (0.82 logits at the median scale of 26, 0.44 at the
# least) leave room for other CPUs' kernels; the oracle's margin exceeds them at two thirds
# of those steps (median margin 1.38 logits), and there a run must match.
BF16_TIE_MARGIN = 8 * 2**-8


def assert_greedy_matches_up_to_a_near_tie(
    got: list[int], ref: list[int], ref_logits: list[torch.Tensor],
    rel_margin: float = BF16_TIE_MARGIN,
) -> int:
    """Asserts that `got` equals the oracle's greedy tokens `ref` (with each step's logits
    `ref_logits`, as oracle.hf_greedy returns them) up to their first divergence, and that the
    oracle had a near tie there: the logit of the token `got` chose is within rel_margin
    times the row's largest |logit| of the oracle's top. Returns how many leading tokens
    agree."""
    assert len(got) == len(ref) == len(ref_logits), (len(got), len(ref), len(ref_logits))
    for pos, (g, r, logits) in enumerate(zip(got, ref, ref_logits)):
        assert int(logits.argmax()) == r, f"token {pos}: ref is not its logits' argmax"
        if g == r:
            continue
        top, second = logits.float().topk(2).values.tolist()
        scale = float(logits.abs().max())
        bound = rel_margin * scale
        gap = top - float(logits[g])
        assert gap < bound, (
            f"token {pos}: got {g}, oracle {r}, and no near tie there: the oracle's logit "
            f"for {g} is {gap:.4f} below its top {top:.3f} (top-2 margin {top - second:.4f}), "
            f"bound {bound:.4f} = {rel_margin:.4f} * largest |logit| {scale:.3f}; tokens "
            f"before {pos} agree:\ngot    {got}\noracle {ref}")
        return pos
    return len(got)
