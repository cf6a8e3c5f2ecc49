"""Triton kernels for the GPU fast path: attention over the paged KV cache and the fused
elementwise layers around it. Each module holds one kernel and a wrapper that checks shapes,
strides and dtypes before launching."""

from shoal.attention.ops.kv_cache_write import write_kv_cache
from shoal.attention.ops.paged_decode import choose_num_splits, paged_decode
from shoal.attention.ops.paged_prefill import paged_prefill
from shoal.attention.ops.rms_norm import fused_add_rms_norm, rms_norm
from shoal.attention.ops.rotary import rotary_embedding
from shoal.attention.ops.silu_mul import silu_and_mul

__all__ = [
    "choose_num_splits",
    "fused_add_rms_norm",
    "paged_decode",
    "paged_prefill",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "write_kv_cache",
]
