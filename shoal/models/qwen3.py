"""Qwen3: the Llama block with RMSNorm on each query and key head, no qkv bias."""

from __future__ import annotations

from shoal.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    qkv_bias = False
