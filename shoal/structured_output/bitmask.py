"""Applying a grammar bitmask to the logits of the structured rows of a batch (torch only)."""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, W] int32 words -> [rows, vocab] bool, True where the token is allowed. Columns
    past the bitmask (a logits row padded beyond the grammar's vocabulary) are not allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] >= vocab:
        return allowed[:, :vocab]
    pad = torch.zeros(allowed.shape[0], vocab - allowed.shape[1], dtype=torch.bool,
                      device=words.device)
    return torch.cat([allowed, pad], dim=1)


def apply_token_bitmask(logits: torch.Tensor, words: torch.Tensor, rows: list[int]) -> None:
    """Sets the disallowed logits of `rows` (row i of `words` is for logits row rows[i]) to
    -inf, in place: one masked fill for the whole batch."""
    allowed = unpack_bitmask(words.to(logits.device, non_blocking=True), logits.shape[-1])
    if rows == list(range(logits.shape[0])):
        logits.masked_fill_(~allowed, _NEG_INF)
        return
    index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    logits[index] = logits[index].masked_fill(~allowed, _NEG_INF)
