"""What the sampler needs to know about the rows of one step, packed as tensors.

Built once per step by the model runner. Every optional feature is None when no row of the
batch uses it, so the common batch (greedy or plain temperature, no penalties) costs the
sampler nothing beyond an argmax or a softmax.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from shoal.host_to_device import tensor_to_device, to_device
from shoal.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A per-request generator on the device the sampler draws its noise on."""
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    return gen


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float32, 0.0 for greedy rows
    top_k: torch.Tensor | None  # [B] int64, vocab_size where disabled
    top_p: torch.Tensor | None  # [B] float32, 1.0 where disabled
    min_p: torch.Tensor | None  # [B] float32, 0.0 where disabled
    all_greedy: bool
    all_random: bool
    generators: dict[int, torch.Generator]  # row -> generator of a seeded request
    presence_penalties: torch.Tensor | None  # [B] float32
    frequency_penalties: torch.Tensor | None  # [B] float32
    repetition_penalties: torch.Tensor | None  # [B] float32
    # [B, max_prompt_len] int64 padded with vocab_size; only set with repetition penalties,
    # the one penalty that also looks at the prompt.
    prompt_token_ids: torch.Tensor | None
    output_token_ids: list[list[int]]
    logit_bias: list[dict[int, float] | None]
    # row -> token ids it may not sample this step: stop tokens and EOS before min_tokens,
    # and bad_words' tokens (the last of a word whose other tokens the output ends with)
    banned_token_ids: dict[int, list[int]]
    max_num_logprobs: int | None
    # row -> the only token ids it may sample; None when no row restricts them.
    allowed_token_ids: dict[int, list[int]] | None = None
    # row -> the ids whose logprobs it reports instead of the top-k; None when no row asks.
    logprob_token_ids: dict[int, list[int]] | None = None

    @property
    def no_penalties(self) -> bool:
        return (
            self.presence_penalties is None
            and self.frequency_penalties is None
            and self.repetition_penalties is None
        )

    @classmethod
    def build(
        cls,
        params_list: Sequence[SamplingParams],
        output_token_ids: list[list[int]],
        prompt_token_ids: Sequence[Sequence[int]],
        generators: dict[int, torch.Generator],
        eos_token_ids: Collection[int] | Sequence[Collection[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Pack one step's rows. eos_token_ids is one set shared by all rows, or one per row."""
        n = len(params_list)
        if len(output_token_ids) != n or len(prompt_token_ids) != n:
            raise ValueError(
                f"need one output and one prompt token list per row (rows={n}, "
                f"outputs={len(output_token_ids)}, prompts={len(prompt_token_ids)})"
            )
        device = torch.device(device)
        greedy = [p.is_greedy for p in params_list]
        all_greedy = all(greedy)  # an empty batch counts as greedy: nothing to draw
        all_random = not all_greedy and not any(greedy)

        temperature = _floats([0.0 if g else p.temperature for p, g in zip(params_list, greedy)],
                              device)
        top_k, top_p, min_p = (None, None, None) if all_greedy else _filters(
            params_list, greedy, vocab_size, device)
        presence_t, frequency_t, repetition_t, prompt_t = _penalties(
            params_list, prompt_token_ids, vocab_size, device)
        banned_token_ids = _banned_token_ids(params_list, output_token_ids, eos_token_ids)
        wanted = [p.logprobs for p in params_list if p.logprobs is not None]
        return cls(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            all_greedy=all_greedy,
            all_random=all_random,
            generators=generators,
            presence_penalties=presence_t,
            frequency_penalties=frequency_t,
            repetition_penalties=repetition_t,
            prompt_token_ids=prompt_t,
            output_token_ids=output_token_ids,
            logit_bias=[p.logit_bias or None for p in params_list],
            banned_token_ids=banned_token_ids,
            max_num_logprobs=max(wanted) if wanted else None,
            allowed_token_ids=_allowed(params_list, output_token_ids, prompt_token_ids),
            logprob_token_ids=_rows_with(params_list, "logprob_token_ids"),
        )


def _allowed(params_list: Sequence[SamplingParams], output_token_ids: list[list[int]],
             prompt_token_ids: Sequence[Sequence[int]]) -> dict[int, list[int]] | None:
    """allowed_token_ids by row, and the thinking end marker alone where a row's thinking
    budget is spent (SamplingParams.thinking_forced)."""
    rows = _rows_with(params_list, "allowed_token_ids") or {}
    for i, p in enumerate(params_list):
        if p.thinking_token_budget is not None:
            forced = p.thinking_forced(output_token_ids[i], prompt_token_ids[i])
            if forced is not None:
                rows[i] = [forced]
    return rows or None


def _rows_with(params_list: Sequence[SamplingParams], name: str) -> dict[int, list[int]] | None:
    rows = {i: ids for i, p in enumerate(params_list) if (ids := getattr(p, name))}
    return rows or None


def _floats(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.float32, device)


def _filters(params_list: Sequence[SamplingParams], greedy: list[bool], vocab_size: int,
             device: torch.device) -> tuple[torch.Tensor | None, ...]:
    """top_k, top_p and min_p per row, or None where no row filters. Filters only matter for
    rows that sample; greedy rows get the no-op value so a mixed batch never builds a filter
    tensor because of a greedy row."""
    ks = [vocab_size if g or p.top_k == 0 else min(p.top_k, vocab_size)
          for p, g in zip(params_list, greedy)]
    ps = [1.0 if g else p.top_p for p, g in zip(params_list, greedy)]
    mps = [0.0 if g else p.min_p for p, g in zip(params_list, greedy)]
    return (to_device(ks, torch.int64, device) if any(k < vocab_size for k in ks) else None,
            _floats(ps, device) if any(v < 1.0 for v in ps) else None,
            _floats(mps, device) if any(v > 0.0 for v in mps) else None)


def _penalties(params_list: Sequence[SamplingParams], prompt_token_ids: Sequence[Sequence[int]],
               vocab_size: int, device: torch.device) -> tuple[torch.Tensor | None, ...]:
    """presence, frequency and repetition penalties per row (None where unused by every
    row), and the padded prompts, which only the repetition penalty reads."""
    presence = [p.presence_penalty for p in params_list]
    frequency = [p.frequency_penalty for p in params_list]
    repetition = [p.repetition_penalty for p in params_list]
    repetition_t = prompt_t = None
    if any(v != 1.0 for v in repetition):
        repetition_t = _floats(repetition, device)
        prompt_t = pad_token_ids(prompt_token_ids, vocab_size, device)
    return (_floats(presence, device) if any(v != 0.0 for v in presence) else None,
            _floats(frequency, device) if any(v != 0.0 for v in frequency) else None,
            repetition_t, prompt_t)


def _banned_token_ids(params_list: Sequence[SamplingParams], output_token_ids: list[list[int]],
                     eos_token_ids: Collection[int] | Sequence[Collection[int]]
                     ) -> dict[int, list[int]]:
    """Row -> the token ids it may not sample this step: before min_tokens its stop tokens
    and, unless ignored, EOS; and its bad words' (bad_word_bans)."""
    n = len(params_list)
    mask: dict[int, list[int]] = {}
    for i, p in enumerate(params_list):
        banned: set[int] = set()
        if p.min_tokens and len(output_token_ids[i]) < p.min_tokens:
            banned.update(p.stop_token_ids or ())
            if not p.ignore_eos:
                banned.update(_row_eos(eos_token_ids, i, n))
        if p.bad_words_token_ids:
            banned.update(bad_word_bans(p.bad_words_token_ids, output_token_ids[i]))
        if banned:
            mask[i] = sorted(banned)
    return mask


def bad_word_bans(words: Sequence[Sequence[int]], output: Sequence[int]) -> set[int]:
    """vLLM's bad_words: a word's last token is banned where the output ends with the rest
    of the word (a one-token word: always). Only the output counts, not the prompt."""
    bans = set()
    for word in words:
        head = len(word) - 1
        if head > len(output):
            continue
        if head == 0 or list(output[len(output) - head:]) == list(word[:head]):
            bans.add(word[-1])
    return bans


def pad_token_ids(
    rows: Sequence[Sequence[int]], pad_id: int, device: torch.device | str
) -> torch.Tensor:
    """[len(rows), longest] int64, short rows right-padded with pad_id (at least one column)."""
    width = max((len(r) for r in rows), default=0) or 1
    # Filling a numpy buffer row by row is several times faster than torch.tensor on nested
    # lists, which matters because penalties re-pack every row's tokens each step.
    padded = np.full((len(rows), width), pad_id, dtype=np.int64)
    for i, row in enumerate(rows):
        padded[i, : len(row)] = row
    return tensor_to_device(torch.from_numpy(padded), device)


def _row_eos(
    eos_token_ids: Collection[int] | Sequence[Collection[int]], row: int, num_rows: int
) -> Collection[int]:
    # A list whose items are themselves collections is per-row; anything else is shared.
    if (
        isinstance(eos_token_ids, Sequence)
        and len(eos_token_ids) == num_rows
        and num_rows > 0
        and not isinstance(eos_token_ids[0], int)
    ):
        return eos_token_ids[row] or ()  # type: ignore[return-value]
    return eos_token_ids or ()  # type: ignore[return-value]
