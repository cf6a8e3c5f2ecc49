"""A linear-attention layer's recurrent state as transferred bytes (prefill/decode
disaggregation of hybrid models: Qwen3-Next, Qwen3.5, Kimi Linear).

A state lives in the page of a block id of the cache tensor the layer shares with the
attention layers (attention/linear_state.py: StatePages); the block of a request's state
table that covers token p holds the state after token p. What moves between engines is the
state's float32 words (the conv state, then the delta-rule state, as StatePages lays them
out), not the page: the two engines' pages may differ in size (block size, attention row),
the words do not. A producer sends the state after the last token whose rows it sends; the
consumer writes it into the block of its own state table that covers that token, which is
where its first computed token reads it from (kv_cache/manager.py: loaded_tokens)."""

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
    # (a copy: the payload's bytes may sit at an offset float32 cannot view)
    words = row.reshape(-1).to(device, copy=True).view(torch.float32)
    total = conv_words + pages.state_shape[0] * pages.state_shape[1] * pages.state_shape[2]
    if words.numel() != total:
        raise ValueError(f"a transferred linear-attention state of {words.numel()} words, "
                         f"this layer's holds {total}")
    pages.write_one(block, words[:conv_words].view(pages.conv_shape),
                    words[conv_words:].view(pages.state_shape))
