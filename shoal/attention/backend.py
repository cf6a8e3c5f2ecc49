"""Attention backends: how the model runner builds per-step metadata and how each attention
layer runs over the paged cache. The torch reference (torch_backend.py) runs anywhere; the
Triton backend (triton_backend.py) is the GPU fast path; selector.py picks one.

The interface declares every call the runner and the layers make. What a backend cannot do
it says with a capability flag (the caller checks the flag, never probes for a method) and
leaves the method to the default here, which raises NotImplementedError."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch


class AttentionBackend(ABC):
    name: str
    # forward_fused: q/k RMSNorm + rotary + cache write in one kernel.
    fuses_rope_and_cache_write: bool = False
    # alloc_graph_buffers / fill_graph_buffers / graph_metadata: decode CUDA graphs.
    supports_cuda_graphs: bool = False
    # alloc_prefill_graph_buffers / fill_prefill_graph_buffers / prefill_graph_metadata:
    # CUDA graphs of one prefill chunk.
    supports_prefill_graphs: bool = False
    # alloc_verify_graph_buffers / fill_verify_graph_buffers / verify_graph_metadata: CUDA
    # graphs of speculative-decoding verify steps (every request k + 1 tokens).
    supports_verify_graphs: bool = False
    # forward_mla: latent attention (DeepSeek MLA) over a one-plane latent cache.
    supports_mla: bool = False
    # advance_graph_buffers: decode graph buffers moved one token on by the device, so the
    # drafting steps of speculative decoding replay back to back (shoal/spec_decode/draft_graphs.py).
    supports_draft_graphs: bool = False

    @abstractmethod
    def build_metadata(self, *, query_lens: list[int], context_lens: list[int],
                       block_tables: list[list[int]], block_size: int, num_decodes: int,
                       sliding_window: int | None, device: torch.device,
                       null_block: int) -> Any:
        """The step's metadata for every layer's forward: requests in order, decodes (one
        query token each) first; null_block is the zeroed block padding may read."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, md: Any, scale: float) -> torch.Tensor:
        """Writes k, v [T, Hk, D] into their slots of kv_cache [2, slots, Hk, D], then
        attends q [T, Hq, D] over each request's context. Returns [T, Hq, D]."""

    def forward_fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
                      eps: float, kv_cache: torch.Tensor, md: Any,
                      scale: float) -> torch.Tensor:
        """forward on q and k before their optional per-head RMSNorm (weight None: none) and
        neox rotary, which the backend applies while writing the cache. Only when
        fuses_rope_and_cache_write; q may be modified in place."""
        raise self._unsupported("fused rotary + cache write")

    def forward_mla(self, q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                    md: Any, scale: float, v_dim: int) -> torch.Tensor:
        """Multi-head latent attention in the weight-absorbed form: writes latent [T, Dk] (each
        new token's compressed KV row: v_dim latent values, then its rotated key part) into
        kv_cache [1, slots, 1, Dk], then attends q [T, H, Dk] over each request's cached rows,
        the whole row as the key and its first v_dim values as the value (one KV head shared
        by every query head). Returns [T, H, v_dim]. Only when supports_mla."""
        raise self._unsupported("latent attention (MLA)")

    def warm_kernels(self, kv_cache: torch.Tensor, num_heads: int, scale: float,
                     block_size: int, sliding_window: int | None) -> int:
        """Compiles, before the first request, every kernel variant a step can pick (for
        backends whose kernels are compiled on first use); returns how many ran."""
        return 0

    def warm_mla_kernels(self, kv_cache: torch.Tensor, num_heads: int, scale: float,
                         block_size: int, v_dim: int) -> int:
        """warm_kernels for latent attention layers (kv_cache [1, slots, 1, Dk])."""
        return 0

    # ---- decode CUDA graphs (supports_cuda_graphs) ---------------------------------------
    def alloc_graph_buffers(self, max_batch: int, max_blocks: int, device: torch.device, *,
                            block_size: int, sliding_window: int | None) -> Any:
        """Persistent metadata inputs for decode batches of up to max_batch rows."""
        raise self._unsupported("decode CUDA graphs")

    def fill_graph_buffers(self, buf: Any, size: int, context_lens: list[int],
                           block_tables: list[list[int]] | None,
                           slot_mapping: list[int]) -> None:
        """A decode batch of len(context_lens) rows into the buffers, padded to `size` rows;
        block_tables None keeps the previous fill's tables."""
        raise self._unsupported("decode CUDA graphs")

    def graph_metadata(self, buf: Any, size: int) -> Any:
        """Metadata over views of the buffers for a graph of `size` rows; its host-side values
        depend on `size` only, so the captured graph replays any fill."""
        raise self._unsupported("decode CUDA graphs")

    def advance_graph_buffers(self, buf: Any, size: int) -> None:
        """Moves each live row of a graph of `size` decode rows one token on, with device
        ops only (a captured graph calls it): its context and sequence lengths grow by one and
        its slot becomes the next position's, through its block table. Padding rows stay
        padding. Only when supports_draft_graphs."""
        raise self._unsupported("drafting CUDA graphs")

    # ---- single-prefill CUDA graphs (supports_prefill_graphs) ----------------------------
    def alloc_prefill_graph_buffers(self, max_tokens: int, max_blocks: int,
                                    device: torch.device, *, block_size: int,
                                    sliding_window: int | None) -> Any:
        """Persistent metadata inputs for one prefill chunk of up to max_tokens tokens."""
        raise self._unsupported("prefill CUDA graphs")

    def fill_prefill_graph_buffers(self, buf: Any, size: int, context_len: int,
                                   block_table: list[int], slot_mapping: list[int]) -> None:
        """One chunk of len(slot_mapping) tokens after context_len cached ones, padded to
        `size` tokens."""
        raise self._unsupported("prefill CUDA graphs")

    def prefill_graph_metadata(self, buf: Any, size: int) -> Any:
        """Metadata over views of the buffers for a prefill graph of `size` tokens."""
        raise self._unsupported("prefill CUDA graphs")

    # ---- verify-step CUDA graphs (supports_verify_graphs) -------------------------------
    def alloc_verify_graph_buffers(self, max_batch: int, q: int, max_blocks: int,
                                   device: torch.device, *, block_size: int,
                                   sliding_window: int | None) -> Any:
        """Persistent metadata inputs for verify steps of up to max_batch requests of q
        query tokens each."""
        raise self._unsupported("verify-step CUDA graphs")

    def fill_verify_graph_buffers(self, buf: Any, size: int, context_lens: list[int],
                                  block_tables: list[list[int]],
                                  slot_mapping: list[int]) -> None:
        """len(context_lens) requests of q tokens after their cached ones, padded to `size`."""
        raise self._unsupported("verify-step CUDA graphs")

    def verify_graph_metadata(self, buf: Any, size: int) -> Any:
        """Metadata over views of the buffers for a verify graph of `size` requests."""
        raise self._unsupported("verify-step CUDA graphs")

    def _unsupported(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"the {self.name} attention backend has no {what}")
