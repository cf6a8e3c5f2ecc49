"""Attention backends: how the model runner builds per-step metadata and how each attention
layer runs over the paged cache. The torch reference (torch_backend.py) runs anywhere; the
Triton backend (triton_backend.py) is the GPU fast path; selector.py picks one.

The interface declares every call the runner and the layers make. What a backend cannot do
it says with a capability flag (the caller checks the flag, never probes for a method) and
leaves the method to the default here, which raises NotImplementedError."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from typing import Any

import torch

from shoal.host_to_device import lists_to_device


class AttentionBackend(ABC):
    name: str
    # forward_fused: q/k RMSNorm + rotary + cache write in one kernel.
    fuses_rope_and_cache_write: bool = False
    # alloc_graph_buffers / fill_graph_buffers / graph_metadata / advance_graph_buffers: CUDA
    # graphs of fixed step shapes (worker/graph_table.py).
    supports_cuda_graphs: bool = False
    # forward_mla: latent attention (DeepSeek MLA) over a one-plane latent cache.
    supports_mla: bool = False
    # forward / forward_fused take `sinks` (gpt-oss): one learned logit per query head that
    # joins the softmax's denominator and carries no value.
    supports_sinks: bool = False
    # forward / forward_fused take `softcap` (Gemma 2: scores capped as
    # softcap * tanh(scores / softcap)). A layer with a cap refuses, when bound, a backend
    # without it: no path may drop the cap silently.
    supports_softcap: bool = False
    # forward_mla takes `select` (DeepSeek-V3.2's indexer: the keys each query reads)
    supports_sparse_mla: bool = False
    # forward / forward_fused take k_scale, v_scale and forward_mla kv_scale: a float8_e4m3fn
    # cache (kv_cache_dtype="fp8", attention/kv_quant.py) written as x / scale and read as
    # stored * scale. The layers pass them only for such a cache.
    supports_fp8_kv_cache: bool = False

    @abstractmethod
    def build_metadata(self, *, query_lens: list[int], context_lens: list[int],
                       block_tables: list[list[int]], block_size: int, num_decodes: int,
                       sliding_window: int | None, device: torch.device,
                       null_block: int) -> Any:
        """The step's metadata for every layer's forward: requests in order, decodes (one
        query token each) first; null_block is the zeroed block padding may read."""

    def build_metadata_and_inputs(self, *, carry: Sequence[Sequence[int]],
                                  **metadata: Any) -> tuple[Any, list[torch.Tensor]]:
        """build_metadata(**metadata) and the int64 lists `carry` (a pass's token ids,
        positions...) on the device; a backend may copy them all at once (Triton)."""
        md = self.build_metadata(**metadata)
        return md, lists_to_device([(c, torch.long) for c in carry], metadata["device"])

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, md: Any, scale: float,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Writes k, v [T, Hk, D] into their slots of kv_cache [2, slots, Hk, D], then
        attends q [T, Hq, D] over each request's context. Returns [T, Hq, D]. sinks [Hq]
        (only when supports_sinks): query head h's softmax also counts exp(sinks[h]).
        k_scale=, v_scale= (only when supports_fp8_kv_cache): an FP8 cache's scales.
        softcap= (only when supports_softcap): scores capped as softcap * tanh(s / softcap)
        before the softmax, masked keys staying out of it."""

    def forward_fused(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                      q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
                      eps: float, kv_cache: torch.Tensor, md: Any,
                      scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """forward on q and k before their optional per-head RMSNorm (weight None: none) and
        neox rotary, which the backend applies while writing the cache. Only when
        fuses_rope_and_cache_write; q may be modified in place. Takes forward's keywords
        (sinks, k_scale, v_scale, softcap) under the same flags."""
        raise self._unsupported("fused rotary + cache write")

    def forward_mla(self, q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                    md: Any, scale: float, v_dim: int, select: Any = None) -> torch.Tensor:
        """Multi-head latent attention in the weight-absorbed form: writes latent [T, Dk] (each
        new token's compressed KV row: v_dim latent values, then its rotated key part) into
        kv_cache [1, slots, 1, Dk], then attends q [T, H, Dk] over each request's cached rows,
        the whole row as the key and its first v_dim values as the value (one KV head shared
        by every query head). Returns [T, H, v_dim]. Only when supports_mla. select (only
        when supports_sparse_mla): a SparseSelection (layers/sparse_indexer.py), the rows
        each query reads; None: all it may see."""
        raise self._unsupported("latent attention (MLA)")

    def warm_kernels(self, kv_cache: torch.Tensor, num_heads: int, scale: float,
                     block_size: int, sliding_window: int | None,
                     q_dtype: torch.dtype | None = None,
                     softcaps: Collection[float | None] = (None,)) -> int:
        """Compiles, before the first request, every kernel variant a step can pick (for
        backends whose kernels are compiled on first use); returns how many ran. q_dtype:
        the activations' (None: the cache's; an FP8 cache needs it); softcaps: the layers'
        attention soft-caps (None: uncapped)."""
        return 0

    def warm_mla_kernels(self, kv_cache: torch.Tensor, num_heads: int, scale: float,
                         block_size: int, v_dim: int, q_dtype: torch.dtype | None = None) -> int:
        """warm_kernels for latent attention layers (kv_cache [1, slots, 1, Dk])."""
        return 0

    # ---- CUDA graphs of fixed step shapes (supports_cuda_graphs) -------------------------
    # A shape is `rows` requests of `q` query tokens each (padded): q = 1 is a decode batch,
    # q > 1 a verify step or a lone prefill chunk. One set of buffers serves every shape.
    def alloc_graph_buffers(self, max_rows: int, max_tokens: int, max_blocks: int,
                            device: torch.device, *, block_size: int,
                            sliding_window: int | None) -> Any:
        """Persistent metadata inputs for shapes of up to max_rows rows and max_tokens tokens
        (rows * q), block tables max_blocks wide."""
        raise self._unsupported("CUDA graphs")

    def fill_graph_buffers(self, buf: Any, rows: int, q: int, context_lens: list[int],
                           block_tables: list[list[int]] | None,
                           slot_mapping: list[int]) -> None:
        """len(context_lens) <= rows real requests of q tokens each after their cached ones
        (slot_mapping: q slots per real request, -1 for its padding tokens), padded to `rows`;
        block_tables None keeps the previous fill's tables."""
        raise self._unsupported("CUDA graphs")

    def graph_metadata(self, buf: Any, rows: int, q: int, blocks: int | None = None) -> Any:
        """Metadata over views of the buffers for a graph of `rows` x `q` tokens; its host-side
        values depend on the shape only, so the captured graph replays any fill. blocks: the
        block tables' first columns only (None: their whole width)."""
        raise self._unsupported("CUDA graphs")

    def advance_graph_buffers(self, buf: Any, rows: int) -> None:
        """Moves each live row of a decode shape (q = 1) one token on, with device ops only
        (a captured graph calls it): its context and sequence lengths grow by one and its slot
        becomes the next position's, through its block table. Padding rows stay padding. The
        drafting steps of speculative decoding replay back to back this way
        (shoal/spec_decode/draft_graphs.py)."""
        raise self._unsupported("CUDA graphs")

    def _unsupported(self, what: str) -> NotImplementedError:
        return NotImplementedError(f"the {self.name} attention backend has no {what}")
