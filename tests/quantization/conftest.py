"""The dense tiny checkpoints every quantized one is made from (written once a session).

Without a GPU the fast path's Triton kernels run in Triton's interpreter on CPU tensors:
triton.jit reads TRITON_INTERPRET when a kernel is defined (its module's import), and pytest
imports this file before the test modules beside it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Qwen3-MoE: 4 experts, top-2, layer 1 dense (mlp_only_layers); DeepSeek-V3: MLA, 8 routed
# experts and a shared one, layer 0 dense (first_k_dense_replace).
QWEN3_MOE = dict(num_hidden_layers=2, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True, head_dim=16)


@pytest.fixture(scope="session")
def dense_checkpoints(tmp_path_factory) -> dict[str, Path]:
    from deepseek_tiny import V3, write_deepseek
    from oracle import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("dense")
    return {
        "llama": write_tiny_checkpoint(root / "llama", "llama", seed=11),
        "qwen3_moe": write_tiny_checkpoint(root / "qwen3_moe", "qwen3_moe", seed=12,
                                           **QWEN3_MOE),
        "deepseek_v3": write_deepseek(root / "deepseek_v3", "deepseek_v3", 13,
                                      **dict(V3, num_hidden_layers=2))[0],
    }
