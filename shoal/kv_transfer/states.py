"""A linear-attention layer's recurrent state as transferred bytes (prefill/decode
disaggregation of hybrid models: Qwen3-Next, Qwen3.5, Kimi Linear).

A state lives in the page of a block id of the cache tensor the layer shares with the
attention layers (attention/linear_state.py: StatePages); the block of a request's state
table that covers token p holds the state after token p. What moves between engines is the
state's float32 words (the conv state, then the delta-rule state, as StatePages lays them
out), not the page: the two engines' pages may differ in size (block size, attention row),
the words do not. A producer sends the state after the last token whose rows it sends; the
consumer writes it into the block of its own state table that covers that token, which is
where its first computed token reads it from (kv_cache/manager.py: loaded_tokens).

The two engines' tensor-parallel sizes may differ: a payload holds a layer's state in the
model's order, whatever the producer's TP size. Each rank holds its slice of every part of
the conv channels (LinearStateSpec.conv_parts: Gated DeltaNet's and KDA's q | k | v heads)
and of the value heads, so the model's order is, part after part, every rank's channels of
that part in rank order (a channel's conv_width words each), then every rank's heads in rank
order ([key_dim, value_dim] words each). A producer's TP rank 0 puts its ranks' states in
that order (to_model_order) and each consumer rank takes its slices back out (rank_share);
with one rank on a side the order is that rank's own, and the bytes move unchanged."""

from __future__ import annotations

import torch

from shoal.attention.linear_state import StatePages
from shoal.core.kv_cache_spec import LinearStateSpec


def state_pages(cache: torch.Tensor, block_size: int, spec: LinearStateSpec) -> StatePages:
    """The layer's states inside its cache tensor (this rank's heads)."""
    return StatePages(cache, block_size, (spec.conv_dim, spec.conv_width),
                      (spec.state_heads, spec.key_dim, spec.value_dim))


def read_state(pages: StatePages, block: int) -> torch.Tensor:
    """The state held in `block` as its bytes, one row: [1, 1, 1, 4 * state words] uint8 (a
    copy, on the cache's device)."""
    conv, state = pages.read_one(block)
    words = torch.cat([conv.reshape(-1), state.reshape(-1)])
    return words.view(torch.uint8).view(1, 1, 1, -1)


def write_state(pages: StatePages, block: int, row: torch.Tensor) -> None:
    """Writes a state's bytes (as read_state gives them, any shape of that many bytes, on
    any device) into `block`."""
    conv_words = pages.conv_words
    device = pages.words.device
    row = row.reshape(-1)
    if row.device != device or row.data_ptr() % 4 or row.storage_offset() % 4:
        # (a copy: the payload's bytes may sit at an offset float32 cannot view)
        row = row.to(device, copy=True)
    words = row.view(torch.float32)
    total = conv_words + pages.state_shape[0] * pages.state_shape[1] * pages.state_shape[2]
    if words.numel() != total:
        raise ValueError(f"a transferred linear-attention state of {words.numel()} words, "
                         f"this layer's holds {total}")
    pages.write_one(block, words[:conv_words].view(pages.conv_shape),
                    words[conv_words:].view(pages.state_shape))


def _segments(spec: LinearStateSpec) -> list[int]:
    """The bytes of one rank's slice of each part of its state, in order: the conv parts,
    then the delta-rule heads."""
    parts = spec.conv_parts or (spec.conv_dim,)
    if sum(parts) != spec.conv_dim:
        raise ValueError(f"conv_parts {parts} do not add up to conv_dim {spec.conv_dim}")
    return [4 * n * spec.conv_width for n in parts] + [
        4 * spec.state_heads * spec.key_dim * spec.value_dim]


def to_model_order(ranks: torch.Tensor, spec: LinearStateSpec,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """Every rank's state bytes (as read_state gives them; [ranks, state bytes], in rank
    order) in the model's order: [ranks * state bytes] uint8, into `out` (flat uint8, any
    device: the copies are queued) or a new tensor on their device."""
    world = ranks.shape[0]
    ranks = ranks.reshape(world, spec.state_bytes)
    if out is None:
        out = torch.empty(world * spec.state_bytes, dtype=torch.uint8, device=ranks.device)
    src = dst = 0
    for size in _segments(spec):  # one copy a part: every rank's slice of it
        out[dst:dst + world * size].view(world, size).copy_(ranks[:, src:src + size],
                                                             non_blocking=True)
        src, dst = src + size, dst + world * size
    return out


def rank_share(row: torch.Tensor, spec: LinearStateSpec, rank: int,
               world: int) -> torch.Tensor:
    """Rank `rank` of `world`'s state bytes (as write_state takes them) out of a state in the
    model's order (uint8, any shape; spec: this rank's layer). ValueError when its size is
    not `world` states of this rank's."""
    row = row.reshape(-1)
    if row.numel() != world * spec.state_bytes:
        raise ValueError(f"a transferred linear-attention state of {row.numel()} bytes does "
                         f"not split into {world} tensor-parallel ranks' states of "
                         f"{spec.state_bytes} bytes (another model, or its heads do not "
                         f"divide over {world} ranks)")
    if world == 1:
        return row
    pieces, at = [], 0
    for size in _segments(spec):
        pieces.append(row[at + rank * size:at + (rank + 1) * size])
        at += world * size
    return torch.cat(pieces)
