"""Reference attention over the paged KV cache in plain PyTorch.

Per layer: write the new keys/values into their slots, then gather each request's context
block by block and run scaled-dot-product attention, decodes as one batch and prefill chunks
as another. Writing before reading lets a request read blocks that another request in the
same step is filling (prefix-cache hits on blocks computed in this very step).

Grouped-query attention never copies keys per query head: the query heads that share a KV
head are laid out as extra query rows of that head.

On the CPU the decode rows go to the C++ kernel of ops/cpu_paged_decode.py when it is built
it reads the blocks in place, where the gather here copies every context (30 MB per layer
per step at batch 64 x 600 tokens for SmolLM2). The SDPA path stays as the reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shoal.attention.backend import AttentionBackend
from shoal.attention.metadata import AttentionMetadata, build_attention_metadata
from shoal.attention.ops import cpu_kv_cache_write
from shoal.attention.ops import cpu_paged_decode as cpu_kernel


class TorchAttentionBackend(AttentionBackend):
    """The reference backend: no fused rotary, no CUDA graphs (the interface's defaults)."""

    name = "torch"
    fuses_rope_and_cache_write = False
    supports_cuda_graphs = False
    supports_mla = True

    def build_metadata(self, *, query_lens: list[int], context_lens: list[int],
                       block_tables: list[list[int]], block_size: int, num_decodes: int,
                       sliding_window: int | None, device: torch.device,
                       null_block: int) -> AttentionMetadata:
        return build_attention_metadata(
            query_lens=query_lens, context_lens=context_lens, block_tables=block_tables,
            block_size=block_size, num_decodes=num_decodes, sliding_window=sliding_window,
            device=device, null_block=null_block)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, md: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache, md, scale)

    def forward_mla(self, q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                    md: AttentionMetadata, scale: float, v_dim: int) -> torch.Tensor:
        return paged_latent_attention(q, latent, kv_cache, md, scale, v_dim)


def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, num_slots, Hk, D]; k, v: [T, Hk, D]."""
    if (k.dim() == 3 and kv_cache.dim() == 4 and k.dtype == kv_cache.dtype and v.dtype == k.dtype
            and slot_mapping.dtype == torch.int64
            and k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.is_contiguous()
            and cpu_kv_cache_write.usable(k)):
        cpu_kv_cache_write.write_kv_cache(kv_cache, k, v, slot_mapping.contiguous())
        return
    kv_cache[0].index_copy_(0, slot_mapping, k)
    kv_cache[1].index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    md: AttentionMetadata, scale: float,
                    decode_kernel: bool = True) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hk, D]. Returns [T, Hq, D]. decode_kernel=False keeps the
    decode rows on the SDPA reference even where the CPU kernel could take them."""
    write_kv_cache(kv_cache, k, v, md.slot_mapping)
    t, hq, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    out = torch.empty_like(q)
    nd = md.num_decodes
    if nd:
        if decode_kernel and cpu_kernel.fits(q, kv_cache) and cpu_kernel.available():
            cpu_kernel.cpu_paged_decode(out[:nd], q[:nd], kv_cache, md.decode_block_tables,
                                        md.decode_seq_lens, md.block_size, scale,
                                        md.sliding_window)
        else:
            out[:nd] = _decode_sdpa(q[:nd], kv_cache, md, scale, hk)
    for start, n in md.fresh_spans:
        # A whole prompt with nothing cached: causal attention over its own keys, which lets
        # the kernel skip the upper triangle (3x faster than a masked, padded batch on CPU).
        o = F.scaled_dot_product_attention(
            q[start:start + n].transpose(0, 1).unsqueeze(0),
            k[start:start + n].transpose(0, 1).unsqueeze(0),
            v[start:start + n].transpose(0, 1).unsqueeze(0),
            is_causal=True, scale=scale, enable_gqa=hq != hk)
        out[start:start + n] = o[0].transpose(0, 1)
    if md.prefill_mask is not None:
        kc = _gather(kv_cache[0], md.prefill_block_tables, md.block_size)
        vc = _gather(kv_cache[1], md.prefill_block_tables, md.block_size)
        qp = q[md.prefill_token_index]  # [P, Lq, Hq, D]
        p, lq = qp.shape[0], qp.shape[1]
        qp = qp.view(p, lq, hk, g, d).permute(0, 2, 3, 1, 4).reshape(p, hk, g * lq, d)
        o = F.scaled_dot_product_attention(qp, kc, vc, attn_mask=md.grouped_prefill_mask(g),
                                           scale=scale)
        o = o.view(p, hk, g, lq, d).permute(0, 3, 1, 2, 4).reshape(p, lq, hq, d)
        valid = md.prefill_token_valid
        out[md.prefill_token_index[valid]] = o[valid]
    return out


def _decode_sdpa(q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float,
                 hk: int) -> torch.Tensor:
    """The reference decode: gather each context, then one masked, padded SDPA."""
    nd, hq, d = q.shape
    kc = _gather(kv_cache[0], md.decode_block_tables, md.block_size)
    vc = _gather(kv_cache[1], md.decode_block_tables, md.block_size)
    qd = q.view(nd, hk, hq // hk, d)  # query head h uses KV head h // g
    o = F.scaled_dot_product_attention(qd, kc, vc, attn_mask=md.decode_mask, scale=scale)
    return o.reshape(nd, hq, d)


def paged_latent_attention(q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                           md: AttentionMetadata, scale: float, v_dim: int) -> torch.Tensor:
    """MLA, weight-absorbed (see AttentionBackend.forward_mla): q [T, H, Dk], latent [T, Dk],
    kv_cache [1, slots, 1, Dk]. Grouped like paged_attention with one KV head: the H query
    heads are the rows of that head, and a row's value is the first v_dim of its key."""
    cache = kv_cache[0]  # [slots, 1, Dk]
    cache.index_copy_(0, md.slot_mapping, latent.unsqueeze(1))
    t, h, dk = q.shape
    out = q.new_empty(t, h, v_dim)
    nd = md.num_decodes
    if nd:
        kc = _gather(cache, md.decode_block_tables, md.block_size)  # [Bd, 1, S, Dk]
        o = F.scaled_dot_product_attention(q[:nd].unsqueeze(1), kc, kc[..., :v_dim],
                                           attn_mask=md.decode_mask, scale=scale)
        out[:nd] = o[:, 0]
    for start, n in md.fresh_spans:
        k = latent[start:start + n].view(1, 1, n, dk)
        o = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1).unsqueeze(0), k,
                                           k[..., :v_dim], is_causal=True, scale=scale,
                                           enable_gqa=True)
        out[start:start + n] = o[0].transpose(0, 1)
    if md.prefill_mask is not None:
        kc = _gather(cache, md.prefill_block_tables, md.block_size)
        qp = q[md.prefill_token_index]  # [P, Lq, H, Dk]
        p, lq = qp.shape[0], qp.shape[1]
        qp = qp.permute(0, 2, 1, 3).reshape(p, 1, h * lq, dk)
        o = F.scaled_dot_product_attention(qp, kc, kc[..., :v_dim],
                                           attn_mask=md.grouped_prefill_mask(h), scale=scale)
        o = o.view(p, h, lq, v_dim).permute(0, 2, 1, 3)
        valid = md.prefill_token_valid
        out[md.prefill_token_index[valid]] = o[valid]
    return out


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache: [num_slots, Hk, D] -> [B, Hk, N * block_size, D] for block tables [B, N]."""
    b, n = block_tables.shape
    hk, d = cache.shape[1], cache.shape[2]
    blocks = cache.view(-1, block_size * hk * d).index_select(0, block_tables.reshape(-1))
    return blocks.view(b, n * block_size, hk, d).transpose(1, 2)
