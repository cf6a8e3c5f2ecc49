"""StarCoder2 (Starcoder2ForCausalLM): the Llama block (shoal/models/llama.py) with GPT-style
parts: LayerNorms with a bias (norm_epsilon), biases on every projection (use_bias), and a
plain MLP c_fc -> GELU (tanh approximation by hidden_act) -> c_proj instead of SwiGLU. Every
layer slides when config.sliding_window is set (StarCoder2-3B/7B/15B: 4096). Embeddings are
tied by default. Built per pipeline stage (LlamaModel.build_stages). LoRA adapts the MLP's
c_fc and c_proj (PEFT's names for them) beside q/k/v/o_proj."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from shoal.layers.linear import ColumnParallelLinear, RowParallelLinear
from shoal.layers.norm import ResidualLayerNorm
from shoal.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaModel

# hidden_act -> F.gelu's approximate argument
_GELU = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}


class Starcoder2Attention(LlamaAttention):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True, *,
                 layer: int):
        bias = bool(getattr(cfg, "use_bias", True))
        super().__init__(cfg, dtype, qk_norm=False, qkv_bias=bias,
                         use_triton_ops=use_triton_ops, layer=layer)
        if bias:  # Llama's o_proj has no bias beside a qkv bias; StarCoder2's has both
            self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim,
                                            cfg.hidden_size, bias=True, params_dtype=dtype)


class Starcoder2MLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype):
        super().__init__()
        act = getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        if act not in _GELU:
            raise ValueError(f"StarCoder2: hidden_act must be one of {', '.join(_GELU)} "
                             f"(got {act!r})")
        self.approximate = _GELU[act]
        bias = bool(getattr(cfg, "use_bias", True))
        self.c_fc = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, bias=bias,
                                         params_dtype=dtype)
        self.c_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, bias=bias,
                                        params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate))


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    """Llama's forward (pre-norm, the residual add fused into the norm that follows it)."""

    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True, *,
                 layer: int):
        nn.Module.__init__(self)  # not Llama's: it would build RMSNorms and a SwiGLU MLP
        self.self_attn = Starcoder2Attention(cfg, dtype, use_triton_ops, layer=layer)
        self.mlp = Starcoder2MLP(cfg, dtype)
        self.input_layernorm = ResidualLayerNorm(cfg.hidden_size, cfg.norm_epsilon, dtype)
        self.post_attention_layernorm = ResidualLayerNorm(cfg.hidden_size, cfg.norm_epsilon, dtype)


class Starcoder2Model(LlamaModel):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        nn.Module.__init__(self)  # Llama's would build its own layers
        self.build_stages(
            cfg, dtype, lambda i: Starcoder2DecoderLayer(cfg, dtype, use_triton_ops, layer=i),
            lambda: ResidualLayerNorm(cfg.hidden_size, cfg.norm_epsilon, dtype))


class Starcoder2ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }
    lora_extra_leaves: ClassVar[frozenset[str]] = frozenset({"c_fc", "c_proj"})

    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> nn.Module:
        return Starcoder2Model(hf_config, dtype, use_triton_ops)
