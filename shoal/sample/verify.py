"""The model runner's verify step: one sampling row per position of every request (k+1 for
a request with k drafts, 1 for the others), the rejection sampler over them, and reading
back each request's accepted run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from shoal.sample.rejection_sampler import VerifyOutput, rejection_sample
from shoal.sample.row_reductions import rows_finite
from shoal.sample.sampling_metadata import SamplingMetadata

if TYPE_CHECKING:
    from shoal.core.scheduler_output import ModelRunnerOutput
    from shoal.core.types import Logprobs


@dataclass
class VerifyRows:
    counts: list[int]  # rows per request, in sampling order (1 + its drafts)

    def read(self, packed: list[list[int]], lp_rows: list[Logprobs | None],
             serials: Sequence[int], states: Sequence[Any], out: ModelRunnerOutput) -> None:
        """packed: [tokens, accepted, finite] per row. Each request keeps its rows' tokens up
        to the first row whose draft is not accepted (that row's token included)."""
        tokens, accepted, finite = packed
        row = 0
        for serial, st, n in zip(serials, states, self.counts):
            rows = range(row, row + n)
            row += n
            if not all(finite[r] for r in rows):
                out.failed_serials.add(serial)  # the scheduler withdraws its blocks
                continue
            kept: list[int] = []
            for r in rows:
                kept.append(tokens[r])
                if not accepted[r]:
                    break
            st.output_token_ids.extend(kept)
            out.sampled_token_ids[serial] = kept[0]
            lps = lp_rows[rows[0]:rows[0] + len(kept)]
            if n > 1:
                out.verified_token_ids[serial] = kept
                if lps[0] is not None:
                    out.verified_logprobs[serial] = lps  # type: ignore[assignment]
            elif lps[0] is not None:
                out.logprobs[serial] = lps[0]


def verify(logits: torch.Tensor, states: Sequence[Any], drafts: list[list[int]],
           vocab_size: int, device: torch.device, forced_accept: list[bool] | None,
           mask_logits: Any = None) -> tuple[VerifyRows, VerifyOutput, torch.Tensor]:
    """logits: the step's sampling rows (k+1 consecutive ones per request with k drafts).
    states: the requests' RequestState (prompt, outputs, params, generator, eos). Row j of a
    request sees its outputs plus its first j drafts, so penalties and min_tokens count the
    drafts before it, as they will if those are accepted. mask_logits(logits), if given,
    applies the grammar bitmask of constrained requests (every one of their rows)."""
    params, outputs, prompts, eos, draft_ids = [], [], [], [], []
    generators: dict[int, torch.Generator] = {}
    for st, d in zip(states, drafts):
        for j in range(len(d) + 1):
            if st.generator is not None:
                generators[len(params)] = st.generator
            params.append(st.sampling_params)
            outputs.append(st.output_token_ids + d[:j] if j else st.output_token_ids)
            prompts.append(st.prompt_token_ids)
            eos.append(st.eos_token_ids)
            draft_ids.append(d[j] if j < len(d) else -1)
    md = SamplingMetadata.build(params, outputs, prompts, generators, eos, vocab_size, device)
    finite = rows_finite(logits)
    if mask_logits is not None:  # structured rows' grammar bitmask (-inf, after the check)
        mask_logits(logits)
    result = rejection_sample(logits, md, draft_ids, forced_accept)
    return VerifyRows([len(d) + 1 for d in drafts]), result, finite
