"""Reference attention over the paged KV cache in plain PyTorch.

Per layer: write the new keys/values into their slots, then gather each request's context
block by block and run scaled-dot-product attention, decodes as one batch and prefill chunks
as another. Writing before reading lets a request read blocks that another request in the
same step is filling (prefix-cache hits on blocks computed in this very step).

Grouped-query attention never copies keys per query head: the query heads that share a KV
head are laid out as extra query rows of that head.

On the CPU the decode rows go to the C++ kernel of ops/cpu_paged_decode.py when it is built
it reads the blocks in place, where the gather here copies every context (30 MB per layer
per step at batch 64 x 600 tokens for SmolLM2). The SDPA path stays as the reference.

Attention sinks (gpt-oss: a learned logit per query head that joins each softmax's
denominator, with no value) take an explicit softmax instead of SDPA, which has no such
term; the C++ decode kernel has none either, so their decodes stay here too.

An FP8 cache (kv_quant.py) is written quantized and read back dequantized to q's dtype, the
new keys of a fresh prompt included (they are attended as the cache keeps them, so a prompt
gives the same result computed at once or read from a prefix hit); the C++ decode kernel
reads only caches of q's dtype, so FP8 decodes take the SDPA path (its `fits`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from shoal.attention import kv_quant
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
    supports_sinks = True
    supports_softcap = True
    supports_sparse_mla = True
    supports_fp8_kv_cache = True

    def build_metadata(self, *, query_lens: list[int], context_lens: list[int],
                       block_tables: list[list[int]], block_size: int, num_decodes: int,
                       sliding_window: int | None, device: torch.device,
                       null_block: int) -> AttentionMetadata:
        return build_attention_metadata(
            query_lens=query_lens, context_lens=context_lens, block_tables=block_tables,
            block_size=block_size, num_decodes=num_decodes, sliding_window=sliding_window,
            device=device, null_block=null_block)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: torch.Tensor, md: AttentionMetadata, scale: float,
                sinks: torch.Tensor | None = None, *, k_scale: float = 1.0,
                v_scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache, md, scale, sinks=sinks, k_scale=k_scale,
                               v_scale=v_scale, softcap=softcap)

    def forward_mla(self, q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                    md: AttentionMetadata, scale: float, v_dim: int,
                    select: Any = None, *, kv_scale: float = 1.0) -> torch.Tensor:
        return paged_latent_attention(q, latent, kv_cache, md, scale, v_dim, select,
                                      kv_scale=kv_scale)


def write_kv_cache(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, num_slots, Hk, D]; k, v: [T, Hk, D] (already FP8 for an FP8 cache)."""
    if kv_quant.is_fp8(kv_cache):
        kv_quant.copy_rows(kv_cache[0], slot_mapping, k)
        kv_quant.copy_rows(kv_cache[1], slot_mapping, v)
        return
    if (k.dim() == 3 and kv_cache.dim() == 4 and k.dtype == kv_cache.dtype and v.dtype == k.dtype
            and slot_mapping.dtype == torch.int64
            and k.stride(-1) == 1 and v.stride(-1) == 1 and kv_cache.is_contiguous()
            and cpu_kv_cache_write.usable(k)):
        cpu_kv_cache_write.write_kv_cache(kv_cache, k, v, slot_mapping.contiguous())
        return
    kv_cache[0].index_copy_(0, slot_mapping, k)
    kv_cache[1].index_copy_(0, slot_mapping, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    md: AttentionMetadata, scale: float, decode_kernel: bool = True,
                    sinks: torch.Tensor | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hk, D]; sinks: [Hq] or None. Returns [T, Hq, D].
    decode_kernel=False keeps the decode rows on the SDPA reference even where the CPU kernel
    could take them. k_scale, v_scale: an FP8 cache's scales (unused otherwise). softcap:
    scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2), or None."""
    scales = (k_scale, v_scale)
    if kv_quant.is_fp8(kv_cache):
        kq, vq = kv_quant.quantize(k, k_scale), kv_quant.quantize(v, v_scale)
        write_kv_cache(kv_cache, kq, vq, md.slot_mapping)
        k = kv_quant.dequantize(kq, k_scale, q.dtype)
        v = kv_quant.dequantize(vq, v_scale, q.dtype)
    else:
        write_kv_cache(kv_cache, k, v, md.slot_mapping)
    t, hq, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    out = torch.empty_like(q)
    nd = md.num_decodes
    if nd:
        if (sinks is None and not softcap and decode_kernel and cpu_kernel.fits(q, kv_cache)
                and cpu_kernel.available()):
            cpu_kernel.cpu_paged_decode(out[:nd], q[:nd], kv_cache, md.decode_block_tables,
                                        md.decode_seq_lens, md.block_size, scale,
                                        md.sliding_window)
        else:
            out[:nd] = _decode_sdpa(q[:nd], kv_cache, md, scale, hk, sinks, scales, softcap)
    for start, n in md.fresh_spans:
        if sinks is not None or softcap:
            out[start:start + n] = causal_attention_with_sinks(
                q[start:start + n], k[start:start + n], v[start:start + n], scale, sinks,
                softcap)
            continue
        # A whole prompt with nothing cached: causal attention over its own keys, which lets
        # the kernel skip the upper triangle (3x faster than a masked, padded batch on CPU).
        o = F.scaled_dot_product_attention(
            q[start:start + n].transpose(0, 1).unsqueeze(0),
            k[start:start + n].transpose(0, 1).unsqueeze(0),
            v[start:start + n].transpose(0, 1).unsqueeze(0),
            is_causal=True, scale=scale, enable_gqa=hq != hk)
        out[start:start + n] = o[0].transpose(0, 1)
    if md.prefill_mask is not None:
        kc, vc = _gather_kv(kv_cache, md.prefill_block_tables, md.block_size, scales, q.dtype)
        qp = q[md.prefill_token_index]  # [P, Lq, Hq, D]
        p, lq = qp.shape[0], qp.shape[1]
        qp = qp.view(p, lq, hk, g, d).permute(0, 2, 3, 1, 4).reshape(p, hk, g * lq, d)
        o = _sdpa(qp, kc, vc, md.grouped_prefill_mask(g), scale,
                  None if sinks is None else _sink_rows(sinks, hk, lq), softcap)
        o = o.view(p, hk, g, lq, d).permute(0, 3, 1, 2, 4).reshape(p, lq, hq, d)
        valid = md.prefill_token_valid
        out[md.prefill_token_index[valid]] = o[valid]
    return out


def _decode_sdpa(q: torch.Tensor, kv_cache: torch.Tensor, md: AttentionMetadata, scale: float,
                 hk: int, sinks: torch.Tensor | None = None,
                 scales: tuple[float, float] = (1.0, 1.0),
                 softcap: float | None = None) -> torch.Tensor:
    """The reference decode: gather each context, then one masked, padded SDPA."""
    nd, hq, d = q.shape
    kc, vc = _gather_kv(kv_cache, md.decode_block_tables, md.block_size, scales, q.dtype)
    qd = q.view(nd, hk, hq // hk, d)  # query head h uses KV head h // g
    o = _sdpa(qd, kc, vc, md.decode_mask, scale,
              None if sinks is None else _sink_rows(sinks, hk, 1), softcap)
    return o.reshape(nd, hq, d)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
          sink_rows: torch.Tensor | None, softcap: float | None = None) -> torch.Tensor:
    """q [B, Hk, R, D] (R rows: the group's query heads x queries), k, v [B, Hk, S, D], mask
    bool broadcastable to [B, Hk, R, S]. sink_rows [Hk, R]: each row's sink logit, which the
    softmax counts beside the keys; softcap: scores capped as softcap * tanh(s / softcap).
    Either is computed explicitly, in float32 (SDPA has neither)."""
    if sink_rows is None and not softcap:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sink_rows is None:
        return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
    sink = sink_rows.float()[None, :, :, None].expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v)


def _sink_rows(sinks: torch.Tensor, hk: int, queries: int) -> torch.Tensor:
    """[Hq] -> [Hk, g * queries]: the sink of each row of the head-group-major layout."""
    g = sinks.shape[0] // hk
    return sinks.view(hk, g, 1).expand(hk, g, queries).reshape(hk, g * queries)


def causal_attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                scale: float, sinks: torch.Tensor | None,
                                softcap: float | None = None) -> torch.Tensor:
    """A whole prompt's causal attention over its own keys, with sinks and/or a soft cap
    (explicit scores): q [n, Hq, D], k, v [n, Hk, D] -> [n, Hq, D]."""
    n, hq, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    qg = q.reshape(n, hk, g, d).permute(1, 2, 0, 3).reshape(1, hk, g * n, d)
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    o = _sdpa(qg, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
              causal.repeat(g, 1), scale,
              None if sinks is None else _sink_rows(sinks, hk, n), softcap)
    return o.view(hk, g, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)


def paged_latent_attention(q: torch.Tensor, latent: torch.Tensor, kv_cache: torch.Tensor,
                           md: AttentionMetadata, scale: float, v_dim: int,
                           select: Any = None, kv_scale: float = 1.0) -> torch.Tensor:
    """MLA, weight-absorbed (see AttentionBackend.forward_mla): q [T, H, Dk], latent [T, Dk],
    kv_cache [1, slots, 1, Dk]. Grouped like paged_attention with one KV head: the H query
    heads are the rows of that head, and a row's value is the first v_dim of its key.
    select: a SparseSelection, ANDed with each kind of row's mask (DeepSeek-V3.2).
    kv_scale: an FP8 cache's one scale of the latent row (unused otherwise)."""
    cache = kv_cache[0]  # [slots, 1, Dk]
    if kv_quant.is_fp8(cache):
        stored = kv_quant.quantize(latent, kv_scale)
        kv_quant.copy_rows(cache, md.slot_mapping, stored.unsqueeze(1))
        latent = kv_quant.dequantize(stored, kv_scale, q.dtype)
    else:
        cache.index_copy_(0, md.slot_mapping, latent.unsqueeze(1))
    t, h, dk = q.shape
    out = q.new_empty(t, h, v_dim)
    nd = md.num_decodes
    if nd:
        kc = _read(cache, md.decode_block_tables, md.block_size, kv_scale, q.dtype)
        mask = md.decode_mask
        if select is not None and select.decode is not None:
            mask = mask & select.decode
        o = F.scaled_dot_product_attention(q[:nd].unsqueeze(1), kc, kc[..., :v_dim],
                                           attn_mask=mask, scale=scale)
        out[:nd] = o[:, 0]
    for i, (start, n) in enumerate(md.fresh_spans):
        k = latent[start:start + n].view(1, 1, n, dk)
        picked = select.fresh[i] if select is not None else None
        causal = {"is_causal": True} if picked is None else {"attn_mask": picked}
        o = F.scaled_dot_product_attention(q[start:start + n].transpose(0, 1).unsqueeze(0), k,
                                           k[..., :v_dim], scale=scale, enable_gqa=True,
                                           **causal)
        out[start:start + n] = o[0].transpose(0, 1)
    if md.prefill_mask is not None:
        kc = _read(cache, md.prefill_block_tables, md.block_size, kv_scale, q.dtype)
        qp = q[md.prefill_token_index]  # [P, Lq, H, Dk]
        p, lq = qp.shape[0], qp.shape[1]
        qp = qp.permute(0, 2, 1, 3).reshape(p, 1, h * lq, dk)
        mask = md.grouped_prefill_mask(h)
        if select is not None and select.prefill is not None:
            sel = select.prefill  # [P, 1, Lq, S] -> each query head's rows, head-major
            mask = mask & sel.expand(p, h, lq, sel.shape[-1]).reshape(p, 1, h * lq, -1)
        o = F.scaled_dot_product_attention(qp, kc, kc[..., :v_dim], attn_mask=mask,
                                           scale=scale)
        o = o.view(p, h, lq, v_dim).permute(0, 2, 1, 3)
        valid = md.prefill_token_valid
        out[md.prefill_token_index[valid]] = o[valid]
    return out


def _gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor, block_size: int,
               scales: tuple[float, float], dtype: torch.dtype,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's keys and values [B, Hk, S, D], in dtype."""
    return (_read(kv_cache[0], block_tables, block_size, scales[0], dtype),
            _read(kv_cache[1], block_tables, block_size, scales[1], dtype))


def _read(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int, scale: float,
          dtype: torch.dtype) -> torch.Tensor:
    """_gather, dequantized from an FP8 cache (only the gathered blocks)."""
    rows = _gather(cache, block_tables, block_size)
    return kv_quant.dequantize(rows, scale, dtype) if kv_quant.is_fp8(cache) else rows


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """cache: [num_slots, Hk, D] -> [B, Hk, N * block_size, D] for block tables [B, N]."""
    b, n = block_tables.shape
    hk, d = cache.shape[1], cache.shape[2]
    blocks = cache.view(-1, block_size * hk * d).index_select(0, block_tables.reshape(-1))
    return blocks.view(b, n * block_size, hk, d).transpose(1, 2)
