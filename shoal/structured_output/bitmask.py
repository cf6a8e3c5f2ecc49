"""Applying a grammar bitmask to the logits of the structured rows of a batch (torch only).

The bitmask is int32 words, bit j of word w for token 32 * w + j. The words are read as
little-endian bytes and each byte looked up in a 256 x 8 table: an elementwise int32 shift
costs far more on the CPU (about 20 ms a row of 49k tokens on this machine, against 0.04 ms),
and the table serves the GPU as well."""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")
_TABLES: dict[tuple[torch.device, bool], torch.Tensor] = {}


def _bits_of_bytes(device: torch.device, allowed: bool) -> torch.Tensor:
    """[256, 8] bool: bit k of each byte value, lowest first (inverted when not allowed)."""
    table = _TABLES.get((device, allowed))
    if table is None:
        values = torch.arange(256, dtype=torch.int32).unsqueeze(1)
        bits = ((values >> torch.arange(8, dtype=torch.int32)) & 1).bool()
        table = (bits if allowed else ~bits).to(device)
        _TABLES[(device, allowed)] = table
    return table


def unpack_bitmask(words: torch.Tensor, vocab: int, allowed: bool = True) -> torch.Tensor:
    """[rows, W] int32 words -> [rows, vocab] bool: True where the token is allowed (or,
    with allowed=False, where it is not). Columns past the bitmask (logits padded beyond the
    grammar's vocabulary) are never allowed."""
    assert words.dtype == torch.int32
    as_bytes = words.contiguous().view(torch.uint8).long()  # little-endian: token order
    bits = _bits_of_bytes(words.device, allowed)[as_bytes].flatten(1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    pad = torch.full((bits.shape[0], vocab - bits.shape[1]), not allowed, dtype=torch.bool,
                     device=words.device)
    return torch.cat([bits, pad], dim=1)


def apply_token_bitmask(logits: torch.Tensor, words: torch.Tensor,
                        rows: list[int] | None = None) -> None:
    """Sets the disallowed logits of `rows` (row i of `words` is for logits row rows[i];
    None: every row, in order) to -inf, in place: one masked fill for the whole batch; columns
    past the bitmask (logits padded beyond the grammar's vocabulary) are set to -inf
    directly."""
    width = min(words.shape[1] * 32, logits.shape[-1])
    banned = unpack_bitmask(words.to(logits.device, non_blocking=True), width, allowed=False)
    if rows is None or (len(rows) == logits.shape[0] and rows == list(range(len(rows)))):
        logits[:, :width].masked_fill_(banned, _NEG_INF)
        if width < logits.shape[-1]:
            logits[:, width:] = _NEG_INF
        return
    index = torch.tensor(rows, dtype=torch.long).to(logits.device, non_blocking=True)
    sub = logits[index]
    sub[:, :width].masked_fill_(banned, _NEG_INF)
    sub[:, width:] = _NEG_INF
    logits[index] = sub
