"""The Triton attention backend as the model runner sees it: eager metadata per step, and
persistent buffers that CUDA-graph replays read their metadata from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from shoal.attention.ops.paged_decode import choose_num_splits
from shoal.attention.triton_backend import (
    TritonAttentionMetadata,
    build_triton_attention_metadata,
    paged_attention_triton,
)


@dataclass
class DecodeGraphBuffers:
    """Device tensors a captured decode graph reads; a step overwrites their first rows."""

    slot_mapping: torch.Tensor  # [B] int64
    block_tables: torch.Tensor  # [B, W] int32
    seq_lens: torch.Tensor  # [B] int32
    context_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32: 0, 1, 2, ...
    host_tables: np.ndarray  # [B, W] int32 staging for block tables
    block_size: int
    num_kv_heads: int
    sliding_window: int | None


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, num_kv_heads: int = 8, sliding_window: int | None = None):
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.block_size = 16

    def build_metadata(self, *, query_lens: list[int], context_lens: list[int],
                       block_tables: list[list[int]], block_size: int, num_decodes: int,
                       sliding_window: int | None, device: torch.device,
                       null_block: int) -> TritonAttentionMetadata:
        # The kernels mask by sequence length, so the null block is not needed here.
        del null_block
        return build_triton_attention_metadata(
            query_lens=query_lens, context_lens=context_lens, block_tables=block_tables,
            block_size=block_size, num_decodes=num_decodes, sliding_window=sliding_window,
            device=device)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: TritonAttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention_triton(q, k, v, kv_cache, md, scale)

    # ---- CUDA graphs ---------------------------------------------------------------------
    def alloc_graph_buffers(self, max_batch: int, max_blocks: int,
                            device: torch.device) -> DecodeGraphBuffers:
        i32 = dict(dtype=torch.int32, device=device)
        return DecodeGraphBuffers(
            slot_mapping=torch.full((max_batch,), -1, dtype=torch.long, device=device),
            block_tables=torch.zeros(max_batch, max_blocks, **i32),
            seq_lens=torch.zeros(max_batch, **i32),
            context_lens=torch.zeros(max_batch, **i32),
            query_start_loc=torch.arange(max_batch + 1, **i32),
            host_tables=np.zeros((max_batch, max_blocks), dtype=np.int32),
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            sliding_window=self.sliding_window,
        )

    def graph_metadata(self, buf: DecodeGraphBuffers, size: int) -> TritonAttentionMetadata:
        width = buf.block_tables.shape[1]
        cap = width * buf.block_size
        return TritonAttentionMetadata(
            num_tokens=size,
            slot_mapping=buf.slot_mapping[:size],
            block_size=buf.block_size,
            num_decodes=size,
            num_decode_rows=size,
            num_prefills=0,
            block_tables=buf.block_tables[:size],
            seq_lens=buf.seq_lens[:size],
            context_lens=buf.context_lens[:size],
            query_start_loc=buf.query_start_loc[: size + 1],
            max_query_len=0,
            max_decode_seq_len=cap,
            max_seq_len=cap,
            sliding_window=buf.sliding_window,
            # Fixed at capture: sized for the longest context a replay may see.
            decode_num_splits=choose_num_splits(size, buf.num_kv_heads, cap,
                                                _num_sms(buf.seq_lens.device)),
        )

    def fill_graph_buffers(self, buf: DecodeGraphBuffers, size: int, context_lens: list[int],
                           block_tables: list[list[int]], slot_mapping: list[int]) -> None:
        n = len(context_lens)
        seq = torch.tensor([c + 1 for c in context_lens] + [0] * (size - n), dtype=torch.int32)
        slots = torch.tensor(list(slot_mapping) + [-1] * (size - n), dtype=torch.long)
        buf.seq_lens[:size].copy_(seq, non_blocking=True)
        buf.context_lens[:size].copy_(seq - (seq > 0).int(), non_blocking=True)
        buf.slot_mapping[:size].copy_(slots, non_blocking=True)
        if n:
            width = max(len(t) for t in block_tables)
            host = buf.host_tables
            for i, t in enumerate(block_tables):
                host[i, : len(t)] = t
            buf.block_tables[:n, :width].copy_(torch.from_numpy(host[:n, :width]),
                                               non_blocking=False)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def make_triton_backend(model: Any, block_size: int) -> TritonAttentionBackend:
    attn = model.attention_layers()[0]
    backend = TritonAttentionBackend(attn.num_kv_heads, attn.sliding_window)
    backend.block_size = block_size
    return backend
