"""Paged decode attention for the CPU: one query token per request, every request's context
read straight from the paged KV cache.

Written as plain tensor expressions for the inductor CPU backend of torch.compile, which
fuses them into loops over (request, KV head): the block-table gather becomes an indirect
load inside the loop (no gathered copy of the context, which cost more than the attention
itself: 268 ms of a 585 ms batch-64 step), each key row is loaded once for all the query
heads that share its KV head (grouped-query attention), and the loops run in parallel over
requests and heads. Run eagerly the same code is correct but slow (it materializes the
products); the torch backend compiles it once per process (`compiled_decode_attention`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class DecodeMetadata:
    """Attention metadata of a step of decodes only (every request adds one token)."""

    slot_mapping: torch.Tensor  # [B] int64: flat cache slot each new token is written to
    block_tables: torch.Tensor  # [B, N] int64, padded with the null block
    seq_lens: torch.Tensor  # [B] int64: tokens in each context, the new one included
    block_size: int
    sliding_window: int | None = None

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_decodes(self) -> int:
        return self.slot_mapping.shape[0]


def build_decode_metadata(context_lens: list[int], block_tables: list[list[int]],
                          block_size: int, sliding_window: int | None,
                          null_block: int) -> DecodeMetadata:
    """Requests with `context_lens` cached tokens, each adding one token."""
    width = max(c // block_size + 1 for c in context_lens)
    tables = torch.full((len(context_lens), width), null_block, dtype=torch.long)
    for i, (t, c) in enumerate(zip(block_tables, context_lens)):
        n = c // block_size + 1
        tables[i, :n] = torch.tensor(t[:n], dtype=torch.long)
    seq_lens = torch.tensor(context_lens, dtype=torch.long) + 1
    last = seq_lens - 1
    slots = tables.gather(1, (last // block_size).unsqueeze(1)).squeeze(1) * block_size
    return DecodeMetadata(slot_mapping=slots + last % block_size, block_tables=tables,
                          seq_lens=seq_lens, block_size=block_size,
                          sliding_window=sliding_window)


def write_decode_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, slots, Hk, D]; k, v: [B, Hk, D]. An index_put_, which inductor keeps in
    place (an index_copy_ of a graph input would be copied whole)."""
    kv_cache[0][slot_mapping] = k
    kv_cache[1][slot_mapping] = v


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, md: DecodeMetadata,
                           scale: float) -> torch.Tensor:
    """q: [B, Hq, D] -> [B, Hq, D] over each request's seq_lens[b] cached tokens."""
    b, hq, d = q.shape
    hk = kv_cache.shape[2]
    g = hq // hk
    n = md.block_tables.shape[1]
    length = n * md.block_size
    blocks = kv_cache.view(2, -1, md.block_size, hk, d)
    k = blocks[0][md.block_tables].view(b, length, hk, 1, d)
    v = blocks[1][md.block_tables].view(b, length, hk, 1, d)
    # Query head h reads KV head h // g: [B, 1, Hk, g, D] against keys [B, L, Hk, 1, D].
    qg = q.view(b, 1, hk, g, d).float()
    scores = (qg * k.float()).sum(-1) * scale  # [B, L, Hk, g]
    pos = torch.arange(length, device=q.device)
    allowed = pos[None, :] < md.seq_lens[:, None]
    if md.sliding_window is not None:
        allowed &= pos[None, :] >= md.seq_lens[:, None] - md.sliding_window
    scores = scores.masked_fill(~allowed[:, :, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=1)
    out = (probs[..., None] * v.float()).sum(1)  # [B, Hk, g, D]
    return out.reshape(b, hq, d).to(q.dtype)


def decode_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   md: DecodeMetadata, scale: float) -> torch.Tensor:
    """Writes the step's keys and values, then attends (the backend's forward for decodes)."""
    write_decode_kv(kv_cache, k, v, md.slot_mapping)
    return paged_decode_attention(q, kv_cache, md, scale)


_COMPILED: dict[str, Any] = {}


def compiled_decode_attention() -> Any:
    """decode_forward compiled on its own, for steps whose model runs eagerly; inside a
    compiled decode step (shoal/worker/cpu_compile.py) the plain function is traced."""
    fn = _COMPILED.get("decode")
    if fn is None:
        fn = _COMPILED["decode"] = torch.compile(decode_forward, dynamic=True)
    return fn
