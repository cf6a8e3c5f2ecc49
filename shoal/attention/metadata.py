"""Per-step attention metadata, built once by the model runner and shared by every layer.

The runner orders a step's requests decodes first (one query token each), then prefill
chunks, so each group is a contiguous slice of the flattened token batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    num_tokens: int
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot written by each token
    # decode group: tokens [0, num_decodes)
    num_decodes: int
    decode_slots: torch.Tensor | None  # [Bd, Ld] int64 flat cache slots of each context
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, Ld] bool, True = attend
    # prefill group: tokens [num_decodes, T), one row per request, padded to max query len
    num_prefills: int
    prefill_token_index: torch.Tensor | None  # [P, Lq] int64 index into the flat tokens
    prefill_token_valid: torch.Tensor | None  # [P, Lq] bool
    prefill_slots: torch.Tensor | None  # [P, Lk] int64 flat cache slots of each context
    prefill_mask: torch.Tensor | None  # [P, 1, Lq, Lk] bool, True = attend


def build_attention_metadata(
    *,
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    num_decodes: int,
    sliding_window: int | None,
    device: torch.device,
    null_slot: int,
) -> AttentionMetadata:
    """query_lens[i] new tokens of request i follow its context_lens[i] cached tokens.
    Requests [0, num_decodes) have query_len 1. Padding positions read `null_slot`, a slot no
    request ever writes (it stays zero): a masked key still enters the product as 0 * value,
    and a stale NaN left in a free block would poison the whole row."""
    num_tokens = sum(query_lens)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    bt = _block_table_tensor(block_tables)
    bs = block_size

    # Slots for the new tokens of every request.
    q_pos = torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)])
    req_of_token = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
    slot_mapping = bt[req_of_token, q_pos // bs] * bs + q_pos % bs

    decode_slots = decode_mask = None
    if num_decodes:
        lk = max(seq_lens[:num_decodes])
        k_pos = torch.arange(lk)
        dlens = torch.tensor(seq_lens[:num_decodes]).unsqueeze(1)
        dbt = bt[:num_decodes]
        decode_slots = dbt.gather(1, (k_pos // bs).clamp(max=dbt.shape[1] - 1).expand(num_decodes, -1)) * bs + k_pos % bs
        allowed = k_pos < dlens
        if sliding_window is not None:
            allowed &= k_pos > (dlens - 1 - sliding_window)
        decode_mask = allowed[:, None, None, :]
        decode_slots = torch.where(allowed, decode_slots, null_slot)

    num_prefills = len(query_lens) - num_decodes
    p_index = p_valid = p_slots = p_mask = None
    if num_prefills:
        pq = query_lens[num_decodes:]
        pc = context_lens[num_decodes:]
        lq, lk = max(pq), max(seq_lens[num_decodes:])
        starts = torch.tensor([num_decodes + sum(pq[:i]) for i in range(num_prefills)])
        qi = torch.arange(lq)
        p_valid = qi < torch.tensor(pq).unsqueeze(1)
        p_index = torch.where(p_valid, starts.unsqueeze(1) + qi, 0)
        k_pos = torch.arange(lk)
        pbt = bt[num_decodes:]
        p_slots = pbt.gather(1, (k_pos // bs).clamp(max=pbt.shape[1] - 1).expand(num_prefills, -1)) * bs + k_pos % bs
        # Query i of request r sits at absolute position pc[r] + i and sees keys <= it.
        abs_q = torch.tensor(pc).unsqueeze(1) + qi  # [P, Lq]
        allowed = (k_pos[None, None, :] <= abs_q[:, :, None]) & p_valid[:, :, None]
        if sliding_window is not None:
            allowed &= k_pos[None, None, :] > abs_q[:, :, None] - sliding_window
        # Padded query rows attend to key 0 only, so softmax stays finite; they are dropped.
        allowed |= (~p_valid[:, :, None]) & (k_pos[None, None, :] == 0)
        p_mask = allowed[:, None]
        p_slots = torch.where(k_pos < torch.tensor(seq_lens[num_decodes:]).unsqueeze(1), p_slots, null_slot)

    def dev(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    return AttentionMetadata(
        num_tokens=num_tokens,
        slot_mapping=dev(slot_mapping),
        num_decodes=num_decodes,
        decode_slots=dev(decode_slots),
        decode_mask=dev(decode_mask),
        num_prefills=num_prefills,
        prefill_token_index=dev(p_index),
        prefill_token_valid=dev(p_valid),
        prefill_slots=dev(p_slots),
        prefill_mask=dev(p_mask),
    )


def _block_table_tensor(block_tables: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(b) for b in block_tables))
    out = torch.zeros(len(block_tables), width, dtype=torch.long)
    for i, b in enumerate(block_tables):
        out[i, : len(b)] = torch.tensor(b, dtype=torch.long)
    return out
