"""Tiny random DeepSeek-V3 and V2 checkpoints written with transformers, and the greedy check
against them, shared by the model, kernel and speculative-decoding tests."""

from __future__ import annotations

import torch
from oracle import check_against_hf, hf_greedy  # noqa: F401 (re-exported for the tests)
from transformers import AutoConfig, AutoModelForCausalLM

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1}
COMMON = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False, kv_lora_rank=32, qk_rope_head_dim=16,
              qk_nope_head_dim=16, v_head_dim=24, first_k_dense_replace=1, n_shared_experts=1,
              num_experts_per_tok=2, n_routed_experts=8)
V3 = dict(COMMON, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
          q_lora_rank=32, rope_interleave=True, rope_parameters=dict(YARN, mscale=1.0,
                                                                     mscale_all_dim=1.0))
V2 = dict(COMMON, q_lora_rank=None, topk_method="group_limited_greedy", n_group=2,
          topk_group=1, routed_scaling_factor=1.5,
          rope_parameters=dict(YARN, mscale=0.707, mscale_all_dim=0.707))


def write_deepseek(path, model_type: str, seed: int, **kw):
    cfg = AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
        for name, b in hf.named_buffers():  # V3's score-correction bias: make it matter
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.5)
    hf.save_pretrained(path, safe_serialization=True)
    return path, hf
