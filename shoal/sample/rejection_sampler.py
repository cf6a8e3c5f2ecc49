"""Verifies drafts against the target model: exact speculative sampling.

A verified request has k+1 rows of logits: row j is the target's next-token distribution p_j
after the context plus drafts d_0..d_{j-1}. Draft d_j is accepted with probability p_j(d_j),
the standard min(1, p/q) test with q a point mass on the draft (ngram drafts are
deterministic); at the first rejection the token is drawn from p_j with d_j removed and
renormalised; if all k are accepted, the bonus token is drawn from p_k. The tokens that come
out are distributed exactly as sampling from the target one token at a time.

p_j is the sampler's own distribution: logit bias, min_tokens, penalties (each row sees the
drafts before it as outputs), temperature, min_p, top-k and top-p. Greedy rows accept a
draft iff it is the argmax. Seeded rows draw from their request's generator."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.host_to_device import to_device
from shoal.sample.row_reductions import argmax_rows
from shoal.sample.sampler import (
    LogprobsTensors,
    compute_logprobs,
    gather_logprobs,
    process_logits,
    random_probs,
    random_sample,
    sample_processed,
)
from shoal.sample.sampling_metadata import SamplingMetadata
from shoal.sampling_params import SAMPLING_EPS


@dataclass
class VerifyOutput:
    # [R] the row's token if the request's run stops at it: its draft when accepted, else the
    # resampled (or bonus) token
    token_ids: torch.Tensor
    accepted: torch.Tensor  # [R] bool: the row's draft is accepted (False for draftless rows)
    logprobs: LogprobsTensors | None  # of token_ids, from the raw logits


def _uniforms(has_draft: list[bool], generators: dict[int, torch.Generator],
              device: torch.device) -> torch.Tensor:
    """U[0, 1) per row; seeded rows with a draft draw theirs from their own generator."""
    u = torch.rand(len(has_draft), device=device)
    for row, gen in generators.items():
        if has_draft[row]:
            u[row] = torch.rand(1, generator=gen, device=device)[0]
    return u


def rejection_sample(logits: torch.Tensor, md: SamplingMetadata, draft_ids: list[int],
                     forced_accept: list[bool] | None = None) -> VerifyOutput:
    """logits: [R, V] target rows; draft_ids: [R] the draft each row verifies, -1 for rows
    that only sample (bonus rows, requests without drafts). forced_accept (test-only timing
    runs): accept these rows' drafts, whatever the target says, unless a grammar bitmask
    banned the draft (its logit is -inf), and give each row the target's own sample."""
    device = logits.device
    raw_logprobs = compute_logprobs(logits) if md.max_num_logprobs is not None else None
    logits = process_logits(logits.to(torch.float32, copy=True), md)
    draft = to_device(draft_ids, torch.long, device)
    has = draft >= 0
    if forced_accept is not None:
        token = sample_processed(logits, md)
        allowed = logits.gather(1, draft.clamp_min(0).unsqueeze(1)).squeeze(1).isfinite()
        accepted = to_device(forced_accept, torch.bool, device) & has & allowed
    elif md.all_greedy:
        token = argmax_rows(logits)
        accepted = has & (draft == token)
    else:
        greedy = None if md.all_random else argmax_rows(logits)
        probs = random_probs(logits, md)
        safe = draft.clamp_min(0).unsqueeze(1)
        p_draft = probs.gather(1, safe).squeeze(1)
        has_list = [d >= 0 for d in draft_ids]
        accepted = has & (_uniforms(has_list, md.generators, device) < p_draft)
        # The draft's column zeroed; the race's argmax needs no renormalisation. A row whose
        # draft had all the mass is never rejected, so its all-zero residual is never used.
        residual = probs.scatter(1, safe, torch.where(has, 0.0, p_draft).unsqueeze(1))
        token = torch.where(accepted, draft, random_sample(residual, md.generators))
        if greedy is not None:
            is_greedy = md.temperature < SAMPLING_EPS
            accepted = torch.where(is_greedy, has & (draft == greedy), accepted)
            token = torch.where(is_greedy, greedy, token)
    logprobs = None
    if raw_logprobs is not None:
        logprobs = gather_logprobs(raw_logprobs, token, md.max_num_logprobs)
    return VerifyOutput(token_ids=token, accepted=accepted, logprobs=logprobs)
