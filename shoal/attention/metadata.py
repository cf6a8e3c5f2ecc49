"""Per-step attention metadata, built once by the model runner and shared by every layer.

The runner orders a step's requests decodes first (one query token each), then prefill
chunks, so each group is a contiguous slice of the flattened token batch. Contexts are read
from the cache a whole block at a time (block tables padded with the null block), which is
several times faster on the CPU than gathering single slots."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from shoal.host_to_device import tensor_to_device


@dataclass(frozen=True)
class GroupedMetadata:
    """One metadata object per KV cache group (shoal/core/kv_cache_spec.py) of a step: each
    attention layer reads its own group's (its block tables, slots and window)."""

    groups: tuple

    def of(self, group: int) -> object:
        return self.groups[group]

    @staticmethod
    def of_groups(mds: list) -> object:
        """A step's metadata: the one group's own, or one per group when there are several."""
        return mds[0] if len(mds) == 1 else GroupedMetadata(tuple(mds))


@dataclass
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot written by each token
    # decode group: tokens [0, num_decodes)
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [Bd, Nd] int64, padded with the null block
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Nd * block_size] bool, True = attend
    decode_seq_lens: torch.Tensor | None  # [Bd] int64, context + 1: what the CPU kernel reads
    # prefill group: tokens [num_decodes, T). Fresh prompts (no cached context) attend with
    # per-request causal attention over their own keys; the rest (chunks after the first,
    # prefix-cache hits) go through the masked, padded path below.
    num_prefills: int
    fresh_spans: list[tuple[int, int]]  # (flat start, length) of each fresh prefill
    prefill_token_index: torch.Tensor | None  # [P, Lq] int64 index into the flat tokens
    prefill_token_valid: torch.Tensor | None  # [P, Lq] bool
    prefill_block_tables: torch.Tensor | None  # [P, Np] int64
    prefill_mask: torch.Tensor | None  # [P, 1, Lq, Np * block_size] bool
    block_size: int
    sliding_window: int | None
    # masks with each row repeated for the query heads sharing a KV head, by group size
    _grouped_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def grouped_prefill_mask(self, group: int) -> torch.Tensor:
        """[P, 1, group * Lq, Lk]: the prefill mask for queries laid out head-group major."""
        m = self._grouped_masks.get(group)
        if m is None:
            p, _, lq, lk = self.prefill_mask.shape
            m = self.prefill_mask.expand(p, group, lq, lk).reshape(p, 1, group * lq, lk)
            self._grouped_masks[group] = m
        return m


def token_slots(query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
                block_size: int) -> list[int]:
    """The flat cache slot of each new token: request i writes positions
    [context_lens[i], context_lens[i] + query_lens[i]) through its block table."""
    slots: list[int] = []
    for c, q, bt in zip(context_lens, query_lens, block_tables):
        slots.extend(bt[p // block_size] * block_size + p % block_size for p in range(c, c + q))
    return slots


def build_attention_metadata(
    *,
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_decodes: int,
    sliding_window: int | None,
    device: torch.device,
    null_block: int,
) -> AttentionMetadata:
    """query_lens[i] new tokens of request i follow its context_lens[i] cached tokens.
    Requests [0, num_decodes) have query_len 1. Block tables are padded with `null_block`, a
    block no request ever writes (it stays zero): masked keys still enter the products as
    0 * value, so what padding reads must be finite."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    slot_mapping = torch.tensor(token_slots(query_lens, context_lens, block_tables, block_size),
                                dtype=torch.long)
    decode_bt = decode_mask = decode_lens = None
    if num_decodes:
        decode_bt, decode_mask = _decode_group(block_tables[:num_decodes],
                                               seq_lens[:num_decodes], block_size,
                                               sliding_window, null_block)
        decode_lens = torch.tensor(seq_lens[:num_decodes], dtype=torch.long)

    fresh: list[tuple[int, int]] = []
    rest: list[int] = []  # prefill requests for the masked path
    start = num_decodes
    for i in range(num_decodes, len(query_lens)):
        # A sliding window needs the mask, so only full-causal models take the fast path.
        if context_lens[i] == 0 and sliding_window is None:
            fresh.append((start, query_lens[i]))
        else:
            rest.append(i)
        start += query_lens[i]
    p_index = p_valid = p_bt = p_mask = None
    if rest:
        flat_starts = [num_decodes + sum(query_lens[num_decodes:i]) for i in rest]
        p_index, p_valid, p_bt, p_mask = _masked_prefills(
            flat_starts, [query_lens[i] for i in rest], [context_lens[i] for i in rest],
            [block_tables[i] for i in rest], [seq_lens[i] for i in rest], block_size,
            sliding_window, null_block)

    def dev(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else tensor_to_device(t, device)

    return AttentionMetadata(
        num_tokens=sum(query_lens),
        slot_mapping=dev(slot_mapping),
        num_decodes=num_decodes,
        decode_block_tables=dev(decode_bt),
        decode_mask=dev(decode_mask),
        decode_seq_lens=dev(decode_lens),
        num_prefills=len(query_lens) - num_decodes,
        fresh_spans=fresh,
        prefill_token_index=dev(p_index),
        prefill_token_valid=dev(p_valid),
        prefill_block_tables=dev(p_bt),
        prefill_mask=dev(p_mask),
        block_size=block_size,
        sliding_window=sliding_window,
    )


def _decode_group(tables: list[list[int]], lens: list[int], bs: int,
                  sliding_window: int | None,
                  null_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables [Bd, Nd] and key mask [Bd, 1, 1, Nd * bs] of the decode requests."""
    decode_bt = _padded_tables(tables, lens, bs, null_block)
    k_pos = torch.arange(decode_bt.shape[1] * bs)
    dlens = torch.tensor(lens).unsqueeze(1)
    allowed = k_pos < dlens
    if sliding_window is not None:
        allowed &= k_pos > (dlens - 1 - sliding_window)
    return decode_bt, allowed[:, None, None, :]


def _masked_prefills(flat_starts: list[int], pq: list[int], pc: list[int],
                     tables: list[list[int]], seq_lens: list[int], bs: int,
                     sliding_window: int | None, null_block: int) -> tuple[torch.Tensor, ...]:
    """Token index and validity [P, Lq], block tables [P, Np] and mask [P, 1, Lq, Np * bs] of
    the prefill chunks that attend through the masked, padded path."""
    lq = max(pq)
    starts = torch.tensor(flat_starts)
    qi = torch.arange(lq)
    p_valid = qi < torch.tensor(pq).unsqueeze(1)
    p_index = torch.where(p_valid, starts.unsqueeze(1) + qi, 0)
    p_bt = _padded_tables(tables, seq_lens, bs, null_block)
    k_pos = torch.arange(p_bt.shape[1] * bs)
    # Query i of request r sits at absolute position pc[r] + i and sees keys <= it.
    abs_q = torch.tensor(pc).unsqueeze(1) + qi  # [P, Lq]
    allowed = (k_pos[None, None, :] <= abs_q[:, :, None]) & p_valid[:, :, None]
    if sliding_window is not None:
        allowed &= k_pos[None, None, :] > abs_q[:, :, None] - sliding_window
    # Padded query rows attend to key 0 only, so softmax stays finite; they are dropped.
    allowed |= (~p_valid[:, :, None]) & (k_pos[None, None, :] == 0)
    return p_index, p_valid, p_bt, allowed[:, None]


def _padded_tables(tables: list[list[int]], seq_lens: list[int], block_size: int,
                   null_block: int) -> torch.Tensor:
    """The blocks covering each sequence, padded to the longest with the null block."""
    used = [-(-n // block_size) for n in seq_lens]
    width = max(used)
    out = torch.full((len(tables), width), null_block, dtype=torch.long)
    for i, (t, n) in enumerate(zip(tables, used)):
        out[i, :n] = torch.tensor(t[:n], dtype=torch.long)
    return out
