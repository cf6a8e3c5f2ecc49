"""Turns one logits row per request into one token per request (plus optional logprobs).

Order follows vLLM V1: logprobs come from the raw logits; then logit_bias, min_tokens masking
and penalties shape the logits; greedy rows take the argmax of that; random rows go through
temperature, min_p, top-k and top-p and are drawn with the exponential race
(argmax of probs / q, q ~ Exp(1)), which needs no cumulative sum and lets each seeded row draw
its q from its own generator, so its tokens do not depend on the rest of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from shoal.host_to_device import to_device
from shoal.sample.row_reductions import argmax_rows
from shoal.sample.sampling_metadata import SamplingMetadata, pad_token_ids
from shoal.sampling_params import SAMPLING_EPS

_NEG_INF = float("-inf")


@dataclass
class LogprobsTensors:
    token_ids: torch.Tensor  # [B, K+1] int64: column 0 = the chosen token, then the top-K ids
    logprobs: torch.Tensor  # [B, K+1] float32
    ranks: torch.Tensor  # [B] int64: rank of the chosen token, 1 = most likely


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.to(torch.float32), dim=-1)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """The chosen token's logprob and rank, followed by the k most likely tokens."""
    token_ids = token_ids.to(torch.int64)
    chosen = logprobs.gather(-1, token_ids.unsqueeze(-1))
    # Ties count in the token's favour, so the argmax always has rank 1.
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    ids, lps = token_ids.unsqueeze(-1), chosen
    if k > 0:
        top_lps, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        ids = torch.cat([ids, top_ids], dim=-1)
        lps = torch.cat([lps, top_lps], dim=-1)
    return LogprobsTensors(token_ids=ids, logprobs=lps, ranks=ranks)


def compute_logprobs_tensors(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> LogprobsTensors:
    """Logprobs of token_ids[i] under logits[i] plus the top k; also serves prompt logprobs."""
    return gather_logprobs(compute_logprobs(logits), token_ids, k)


def gather_token_id_logprobs(lt: LogprobsTensors, logprobs: torch.Tensor,
                             token_ids: dict[int, list[int]]) -> LogprobsTensors:
    """lt with the rows of `token_ids` reporting those ids (after the chosen token in column
    0) instead of their top-k; other rows keep theirs. Columns past a row's count are filler
    that the reader slices away."""
    num_rows, width = lt.token_ids.shape
    width = max(width, 1 + max(len(ids) for ids in token_ids.values()))
    ids = lt.token_ids.new_zeros(num_rows, width)
    ids[:, : lt.token_ids.shape[1]] = lt.token_ids
    rows = [r for r, tids in token_ids.items() for _ in tids]
    cols = [j + 1 for tids in token_ids.values() for j in range(len(tids))]
    vals = [t for tids in token_ids.values() for t in tids]
    index = to_device([rows, cols, vals], torch.int64, ids.device)
    ids[index[0], index[1]] = index[2]
    return LogprobsTensors(token_ids=ids, logprobs=logprobs.gather(-1, ids), ranks=lt.ranks)


def apply_allowed_token_ids(logits: torch.Tensor, allowed: dict[int, list[int]]) -> None:
    """Rows in `allowed` keep only the logits of their ids; other rows are untouched."""
    keep = torch.ones_like(logits, dtype=torch.bool)
    rows = list(allowed)
    index = to_device(rows, torch.int64, logits.device)
    keep[index] = False
    flat_rows = [r for r, ids in allowed.items() for _ in ids]
    flat_ids = [t for ids in allowed.values() for t in ids]
    pairs = to_device([flat_rows, flat_ids], torch.int64, logits.device)
    keep[pairs[0], pairs[1]] = True
    logits.masked_fill_(~keep, _NEG_INF)


def apply_logit_bias(logits: torch.Tensor, logit_bias: list[dict[int, float] | None]) -> None:
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, bias in enumerate(logit_bias):
        if not bias:
            continue
        for token, value in bias.items():
            # Skip ids past the row: on CUDA an out-of-range index kills the whole process.
            if token < vocab:
                rows.append(i)
                cols.append(token)
                vals.append(value)
    if rows:
        index = to_device([rows, cols], torch.int64, logits.device)
        values = to_device(vals, logits.dtype, logits.device)
        logits.index_put_((index[0], index[1]), values, accumulate=True)


def apply_banned_tokens(logits: torch.Tensor, banned_token_ids: dict[int, list[int]]) -> None:
    vocab = logits.shape[-1]
    rows = [i for i, tokens in banned_token_ids.items() for t in tokens if t < vocab]
    cols = [t for tokens in banned_token_ids.values() for t in tokens if t < vocab]
    if rows:
        index = to_device([rows, cols], torch.int64, logits.device)
        logits[index[0], index[1]] = _NEG_INF


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Repetition on prompt+output tokens; frequency and presence on output tokens only.

    Assumes md was built with vocab_size == logits.shape[-1] (that id pads the prompt rows).
    """
    num_rows, vocab = logits.shape
    # One spare column absorbs the padding id, then is sliced away.
    output_ids = pad_token_ids(md.output_token_ids, vocab, logits.device)
    counts = torch.zeros(num_rows, vocab + 1, dtype=logits.dtype, device=logits.device)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    counts = counts[:, :vocab]
    in_output = counts > 0

    if md.repetition_penalties is not None:
        seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device)
        if md.prompt_token_ids is not None:
            seen.scatter_(1, md.prompt_token_ids.to(logits.device), True)
        seen = seen[:, :vocab] | in_output
        penalty = md.repetition_penalties.to(logits.dtype).unsqueeze(1)
        scale = torch.where(seen, penalty, torch.ones_like(penalty))
        # Dividing a positive logit and multiplying a negative one both make the token less likely.
        logits = torch.where(logits > 0, logits / scale, logits * scale)
    if md.frequency_penalties is not None:
        logits = logits - md.frequency_penalties.to(logits.dtype).unsqueeze(1) * counts
    if md.presence_penalties is not None:
        logits = logits - md.presence_penalties.to(logits.dtype).unsqueeze(1) * in_output
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Both filters from one sort. Stable descending order keeps the lowest id first among ties,
    so top_k=1 and a tiny top_p both pick the same token as argmax."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        positions = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        sorted_logits.masked_fill_(positions >= top_k.unsqueeze(1), _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # exactly 0 for the top token: always kept
        p = top_p.unsqueeze(1)
        # Rows at top_p=1 must stay untouched even if float rounding pushes the sum to 1 early.
        sorted_logits.masked_fill_((mass_before >= p) & (p < 1.0), _NEG_INF)
    # Back to vocab order so each row's noise lines up with the same token ids in any batch.
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(probs / q), q ~ Exp(1): an exact draw from probs, one row at a time in parallel."""
    q = torch.empty_like(probs)
    if len(generators) < probs.shape[0]:
        q.exponential_()
    # Unavoidable per-request loop: a generator only fills its own row.
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    # q == 0 would turn a zero-probability token into 0/0 = NaN, which argmax picks.
    q.clamp_min_(torch.finfo(q.dtype).tiny)
    return probs.div_(q).argmax(dim=-1)


def _modifies_logits(md: SamplingMetadata) -> bool:
    return (bool(md.banned_token_ids) or not md.no_penalties or any(md.logit_bias)
            or md.allowed_token_ids is not None)


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        raw_logprobs = None
        if md.max_num_logprobs is not None or md.logprob_token_ids is not None:
            raw_logprobs = compute_logprobs(logits)
        elif md.all_greedy and not _modifies_logits(md):
            # Common decode batch: upcasting is exact, so argmax needs no float32 copy.
            return SamplerOutput(sampled_token_ids=argmax_rows(logits), logprobs=None)
        # Own float32 copy: the in-place steps below must not touch the caller's tensor.
        logits = process_logits(logits.to(torch.float32, copy=True), md)
        sampled = sample_processed(logits, md)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, sampled, md.max_num_logprobs or 0)
            if md.logprob_token_ids is not None:
                logprobs = gather_token_id_logprobs(logprobs, raw_logprobs, md.logprob_token_ids)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def process_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The request-specific shaping every row goes through, greedy or not: allowed token ids,
    logit bias, min_tokens and penalties (in place where it can; float32 logits)."""
    if md.allowed_token_ids is not None:  # first, as vLLM: the rest cannot revive a token
        apply_allowed_token_ids(logits, md.allowed_token_ids)
    apply_logit_bias(logits, md.logit_bias)
    if md.banned_token_ids:
        apply_banned_tokens(logits, md.banned_token_ids)
    if not md.no_penalties:
        logits = apply_penalties(logits, md)
    return logits


def sample_processed(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """One token per row from process_logits' output: greedy rows the argmax, random rows a
    draw from random_probs."""
    if md.all_greedy:
        return argmax_rows(logits)
    greedy = None if md.all_random else logits.argmax(dim=-1)
    sampled = random_sample(random_probs(logits, md), md.generators)
    if greedy is None:
        return sampled
    return torch.where(md.temperature < SAMPLING_EPS, greedy, sampled)


def random_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """What random rows draw from: processed logits (changed in place) through temperature,
    min_p, top-k and top-p. Greedy rows get their distribution at temperature 1, which
    callers ignore. The rejection sampler verifies against it."""
    is_greedy = md.temperature < SAMPLING_EPS
    # Greedy rows divide by 1 (not 0); their random draw is discarded anyway.
    temperature = torch.where(is_greedy, torch.ones_like(md.temperature), md.temperature)
    logits = logits.div_(temperature.unsqueeze(1))
    if md.min_p is not None:
        logits = apply_min_p(logits, md.min_p)
    if md.top_k is not None or md.top_p is not None:
        logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
    return logits.softmax(dim=-1)
