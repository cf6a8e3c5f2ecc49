"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2): which cached tokens each
query's latent attention reads.

Per token it keeps one key row (index_head_dim values: wk, then a LayerNorm, the first
qk_rope_head_dim rotated as halves) in a paged cache of its own (IndexerKeySpec), in the
latent layer's block tables. A query scores every key it may see as
sum_h w_h * relu(q_h . k) / sqrt(index_head_dim), with n_heads indexer query heads
(wq_b of the attention's q_a latent, rotated like the keys) and per-token head weights
(weights_proj / sqrt(n_heads)); attention then reads only its index_topk best keys.

A query that sees at most index_topk keys reads all of them: when every query of a step does
(decodes and chunks within the first index_topk tokens), no selection is made at all and the
layer attends densely, on any backend (the seeds' "skipping topk at decode").

On the torch backend's metadata the selection is a boolean mask in that backend's layout
for each kind of row (decodes, fresh prompts, chunks after a cached prefix), ANDed with the
causal masks there. On the Triton backend's (CUDA) it is every query row's top-k positions
(SparseRows, scored and picked on the device: shoal/layers/sparse_picks.py) for the sparse
latent-attention kernel (shoal/attention/ops/mla_sparse.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.attention import kv_quant
from shoal.attention.backend import AttentionBackend
from shoal.attention.fp8_rows import INDEXER_KEY_BLOCK, BlockScaledRows
from shoal.attention.metadata import AttentionMetadata, GroupedMetadata
from shoal.core.kv_cache_spec import IndexerKeySpec
from shoal.layers.linear import ReplicatedLinear
from shoal.layers.rotary import get_rope, rope_parameters

if TYPE_CHECKING:
    from shoal.attention.ops.mla_sparse import SparseRows


@dataclass
class SparseSelection:
    """What each query attends to (True = read), by kind of row (None: all it may see)."""

    decode: torch.Tensor | None  # [Bd, 1, 1, S] like the decode mask
    fresh: list[torch.Tensor | None]  # per fresh prompt of n tokens: [n, n]
    prefill: torch.Tensor | None  # [P, 1, Lq, S] like the prefill mask


class LightningIndexer(nn.Module):
    num_kv_heads = 1
    sliding_window = None
    fuses_rope = False
    kv_group = 0

    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.rope, self.topk = cfg.qk_rope_head_dim, cfg.index_topk
        if cfg.index_topk < 1:
            raise ValueError(f"index_topk must be >= 1, got {cfg.index_topk}")
        self.wq_b = ReplicatedLinear(cfg.q_lora_rank, self.n_heads * self.head_dim,
                                     params_dtype=dtype)
        self.wk = ReplicatedLinear(cfg.hidden_size, self.head_dim, params_dtype=dtype)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6, dtype=dtype)
        self.k_norm.requires_grad_(False)
        self.weights_proj = ReplicatedLinear(cfg.hidden_size, self.n_heads, params_dtype=dtype)
        theta, scaling = rope_parameters(cfg)
        self.rotary_emb = get_rope(self.head_dim, cfg.max_position_embeddings, theta, scaling,
                                   use_triton_ops=use_triton_ops, rot_dim=self.rope)
        self.scale = self.head_dim ** -0.5
        self.kv_cache: torch.Tensor | None = None  # [1, num_slots, 1, head_dim]
        # With kv_cache_dtype="fp8" the keys are stored as DeepSeek's reference inference
        # keeps them: e4m3 with a float32 scale per 128 values (attention/fp8_rows.py), rows
        # of fp8_keys.row_bytes bytes, read back dequantized (this step's fresh keys too, so
        # a prefix hit scores what a miss does); the queries stay float32.
        self.fp8_keys = BlockScaledRows.of((self.head_dim, INDEXER_KEY_BLOCK))
        self.backend: AttentionBackend | None = None

    def kv_cache_spec(self, dtype_bytes: int) -> IndexerKeySpec:
        fp8 = dtype_bytes == kv_quant.FP8_KV_DTYPE.itemsize
        return IndexerKeySpec(1, self.fp8_keys.row_bytes if fp8 else self.head_dim, dtype_bytes)

    def forward(self, hidden: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor,
                md: Any) -> SparseSelection | SparseRows | None:
        """Caches this step's keys; the selection (masks on the torch backend's metadata,
        SparseRows on the Triton backend's), or None when every query reads every key it may
        see."""
        if isinstance(md, GroupedMetadata):
            md = md.of(self.kv_group)
        if self.kv_cache is None:
            raise RuntimeError("KV cache is not bound to the indexer")
        t = hidden.shape[0]
        q = self.wq_b(q_resid).view(t, self.n_heads, self.head_dim).contiguous()
        k = self.k_norm(self.wk(hidden)).view(t, 1, self.head_dim).contiguous()
        q, k = self.rotary_emb(positions, q, k)
        cache = self.kv_cache[0]  # [slots, 1, D] (FP8: [slots, 1, row_bytes] bytes)
        if not isinstance(md, AttentionMetadata):  # the Triton backend's: SparseRows
            return self._pick_rows(hidden, q, k, cache, md)
        stored = None
        if kv_quant.is_fp8(cache):
            cache = cache.view(torch.uint8)
            stored = self.fp8_keys.quantize(k)
            cache.index_copy_(0, md.slot_mapping, stored)
        else:
            cache.index_copy_(0, md.slot_mapping, k.to(cache.dtype))
        if not _needs_selection(md, self.topk):
            return None  # (the keys unread: none dequantized)
        if stored is not None:
            k = self.fp8_keys.dequantize(stored, k.dtype)  # (what later reads give)
        w = self.weights_proj(hidden).float() * self.n_heads ** -0.5  # [T, H]
        return self._select(q.float(), k[:, 0].float(), w, cache, md)

    def _pick_rows(self, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   cache: torch.Tensor, md: Any) -> SparseRows | None:
        """forward on the Triton backend's metadata: the keys written past padding rows'
        -1 slots, then every query row's top-k positions (sparse_picks.py), or None when no
        row sees more than index_topk keys (max_seq_len: a host value, a captured graph's the
        capacity of its tables, so it decides once per shape). An FP8 cache takes the keys
        as the torch branch stores them (fp8_keys.quantize: device ops only, no host read,
        so a graph captures it; the rows then copied as bytes), and the scores read them
        back with that layout."""
        from shoal.attention.ops.mla_cache_write import write_mla_cache
        from shoal.layers.sparse_picks import pick_rows

        fp8 = self.fp8_keys if kv_quant.is_fp8(cache) else None
        rows = cache[:, 0]  # [slots, D] (FP8: [slots, row_bytes])
        if fp8 is not None:
            rows = rows.view(torch.uint8)
            write_mla_cache(fp8.quantize(k[:, 0]), rows, md.slot_mapping)
        else:
            write_mla_cache(k[:, 0].to(cache.dtype), rows, md.slot_mapping)
        if md.max_seq_len <= self.topk:
            return None
        w = self.weights_proj(hidden).float() * self.n_heads ** -0.5  # [T, H]
        pages = rows.view(-1, md.block_size, rows.shape[-1])
        return pick_rows(q, w, md, pages, self.topk, self.scale, fp8)

    def _scores(self, q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """q [..., Lq, H, D], keys [..., S, D], w [..., Lq, H] -> [..., Lq, S]."""
        s = F.relu(torch.einsum("...qhd,...sd->...qhs", q, keys) * self.scale)
        return torch.einsum("...qh,...qhs->...qs", w, s)

    def _top(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The index_topk best visible keys of each row (all of them where fewer are)."""
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(self.topk, scores.shape[-1])
        picked = torch.zeros_like(visible)
        picked.scatter_(-1, scores.topk(k, dim=-1).indices, True)
        return picked & visible

    def _keys(self, cache: torch.Tensor, tables: torch.Tensor, block_size: int) -> torch.Tensor:
        """Each request's cached keys [B, S, D] float32 (cache as stored: FP8 as uint8)."""
        from shoal.attention.torch_backend import _gather

        keys = _gather(cache, tables, block_size)[:, 0]
        if cache.dtype == torch.uint8:
            return self.fp8_keys.dequantize(keys, torch.float32)
        return keys.float()

    def _select(self, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, cache: torch.Tensor,
                md: AttentionMetadata) -> SparseSelection:
        decode = prefill = None
        nd = md.num_decodes
        if nd:
            keys = self._keys(cache, md.decode_block_tables, md.block_size)
            scores = self._scores(q[:nd, None], keys, w[:nd, None])  # [Bd, 1, S]
            decode = self._top(scores, md.decode_mask[:, 0]).unsqueeze(1)
        fresh: list[torch.Tensor | None] = []
        for start, n in md.fresh_spans:
            if n <= self.topk:
                fresh.append(None)
                continue
            span = slice(start, start + n)
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
            fresh.append(self._top(self._scores(q[span], k[span], w[span]), causal))
        if md.prefill_mask is not None:
            keys = self._keys(cache, md.prefill_block_tables, md.block_size)
            idx = md.prefill_token_index  # [P, Lq]
            scores = self._scores(q[idx], keys, w[idx])  # [P, Lq, S]
            prefill = self._top(scores, md.prefill_mask[:, 0]).unsqueeze(1)
        return SparseSelection(decode, fresh, prefill)


def _needs_selection(md: AttentionMetadata, topk: int) -> bool:
    """Whether some query of the step sees more than topk keys."""
    if md.num_decodes and int(md.decode_mask.sum(-1).max()) > topk:
        return True
    if any(n > topk for _, n in md.fresh_spans):
        return True
    return md.prefill_mask is not None and int(md.prefill_mask.sum(-1).max()) > topk
