"""A step's sampling rows' logits into tokens on their way to the host: the sampler, or for a
step that verifies drafts the rejection sampler over every position of each request. The
finiteness of each row is read before a grammar bitmask masks it (masked logits are -inf)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from shoal.core.scheduler_output import GrammarBitmask
from shoal.sample.host_rows import HostCopy, SampledRows, VerifiedRows
from shoal.sample.row_reductions import rows_finite
from shoal.sample.sampler import Sampler
from shoal.sample.sampling_metadata import SamplingMetadata
from shoal.sample.verify import verify
from shoal.structured_output.bitmask import apply_token_bitmask
from shoal.worker.step_inputs import StepInputs

# Test-only forced acceptance: the drafts per sampling request -> whether each row's draft
# counts as accepted (shoal/spec_decode/forced.py).
AcceptMask = Callable[[list[int]], list[bool]]


def sample_step(inp: StepInputs, logits: torch.Tensor, grammar: GrammarBitmask | None,
                sampler: Sampler, vocab_size: int, accept_mask: AcceptMask | None = None,
                agree: Callable[[torch.Tensor], torch.Tensor] | None = None
                ) -> tuple[SampledRows | VerifiedRows, torch.Tensor | None]:
    """The rows to read once the step is done, and the sampled ids on the device (what the
    next step's pending tokens are taken from; None for a verify step, which nothing reads
    pending tokens from). agree: makes the packed results every rank's (speculation under
    tensor parallelism: the drafters read them), on the device before the host copy."""
    agree = agree or (lambda packed: packed)
    if inp.has_drafts:
        return _verify_step(inp, logits, grammar, vocab_size, accept_mask, agree), None
    states = inp.sample_states
    smd = SamplingMetadata.build(
        [s.sampling_params for s in states],
        [s.output_token_ids for s in states],
        [s.prompt_token_ids for s in states],
        {i: s.generator for i, s in enumerate(states) if s.generator is not None},
        [s.eos_token_ids for s in states],
        vocab_size,
        logits.device,
    )
    finite = rows_finite(logits)
    if grammar is not None:  # after the finiteness check: masked logits are -inf
        serials = grammar.serials
        # Every row structured (the usual batch): no per-row index list.
        rows = None if serials == inp.sample_rows else _rows_of(inp.sample_rows, serials)
        apply_token_bitmask(logits, grammar.bitmask, rows)
    result = sampler(logits, smd)
    # One device-to-host transfer for both, queued behind the step.
    copy = HostCopy.queue(agree(torch.stack([result.sampled_token_ids, finite.long()])),
                          result.logprobs)
    wanted = [s.sampling_params.num_logprobs for s in states]
    return SampledRows(copy, inp.sample_rows, states, wanted), result.sampled_token_ids


def _verify_step(inp: StepInputs, logits: torch.Tensor, grammar: GrammarBitmask | None,
                 vocab_size: int, accept_mask: AcceptMask | None,
                 agree: Callable[[torch.Tensor], torch.Tensor]) -> VerifiedRows:
    """Every request's rows through the rejection sampler."""
    forced = accept_mask([len(d) for d in inp.drafts]) if accept_mask is not None else None
    mask = None
    if grammar is not None:
        # A structured request's k+1 rows each have a bitmask row (after 0..k drafts).
        rows_of: dict[int, range] = {}
        row = 0
        for serial, d in zip(inp.sample_rows, inp.drafts):
            rows_of[serial] = range(row, row + len(d) + 1)
            row += len(d) + 1
        rows = [r for s in grammar.serials for r in rows_of[s]]

        def mask(lg: torch.Tensor) -> None:
            apply_token_bitmask(lg, grammar.bitmask, rows)

    states = inp.sample_states
    rows_read, result, finite = verify(logits, states, inp.drafts, vocab_size, logits.device,
                                       forced, mask)
    copy = HostCopy.queue(agree(torch.stack([result.token_ids, result.accepted.long(),
                                             finite.long()])), result.logprobs)
    wanted = [s.sampling_params.num_logprobs for s, d in zip(states, inp.drafts)
              for _ in range(len(d) + 1)]  # per row
    return VerifiedRows(copy, inp.sample_rows, states, wanted, rows_read)


def _rows_of(sample_rows: list[int], serials: list[int]) -> list[int]:
    """The logits row of each of `serials` (request serials among the step's sample rows)."""
    row_of = {serial: i for i, serial in enumerate(sample_rows)}
    return [row_of[s] for s in serials]
