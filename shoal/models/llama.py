"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2 with qkv bias, Qwen3 with q/k norm).

Projections are fused (qkv, gate_up) and tensor-parallel; `packed_modules_mapping` tells the
loader which checkpoint tensors land in which fused parameter and shard. The model classes
follow shoal/models/interface.py; use_triton_ops reaches every layer with a kernel.

Pipeline parallelism (shoal/distributed/parallel_state.py): a stage builds only its decoder
layers, the others are PPMissingLayer placeholders so that parameter names and layer indices
stay the checkpoint's; the first stage holds embed_tokens, the last the final norm, and stage 0
also lm_head (sampling stays on rank 0, which receives the last stage's final hidden states;
tied embeddings are then one tensor). load_weights skips the tensors of what this stage lacks."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, ClassVar

import torch
from torch import nn

from shoal.distributed.parallel_state import (
    get_pp_world_size,
    pp_is_first,
    pp_is_last,
    pp_layer_range,
)
from shoal.distributed.stage_aux import AuxRoute, aux_route
from shoal.layers.activation import SiluAndMul
from shoal.layers.attention import Attention
from shoal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    load_tensor,
    packed_target,
)
from shoal.layers.norm import RMSNorm
from shoal.layers.rotary import get_rope, rope_parameters


def layer_sliding_window(cfg: Any, layer: int) -> int | None:
    """The layer's sliding window: config.layer_types when the config has them
    ("sliding_attention" layers; Qwen2's from max_window_layers), else every layer's when
    sliding_window is set and use_sliding_window is not false (Mistral)."""
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return window if types[layer] == "sliding_attention" else None
    return window


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, qk_norm: bool, qkv_bias: bool,
                 use_triton_ops: bool = True, *, layer: int, use_rope: bool = True,
                 rot_dim: int | None = None):
        """use_rope False: a layer without positions at all (SmolLM3's NoPE layers);
        rot_dim: the leading dims of each head that rotate (partial rotary; default all)."""
        super().__init__()
        self.hidden_size = cfg.hidden_size
        total_heads = cfg.num_attention_heads
        total_kv = getattr(cfg, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // total_heads
        # attention_bias (Llama's config): q/k/v and o all biased; qkv_bias (Qwen2): q/k/v only
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, total_heads, total_kv,
                                          bias=qkv_bias or attention_bias, params_dtype=dtype)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, cfg.hidden_size,
                                        bias=attention_bias and not qkv_bias,
                                        params_dtype=dtype)
        theta, scaling = rope_parameters(cfg)
        self.rotary_emb = (get_rope(self.head_dim, cfg.max_position_embeddings, theta, scaling,
                                    use_triton_ops=use_triton_ops, rot_dim=rot_dim)
                           if use_rope else None)
        self.qk_norm = qk_norm
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, use_triton_ops)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype, use_triton_ops)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              layer_sliding_window(cfg, layer))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                md: Any) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = hidden.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        rope = self.rotary_emb
        if rope is not None and self.attn.fuses_rope and positions.dim() == 1:
            # norms, rotary, cache write fused
            norms = (self.q_norm, self.k_norm) if self.qk_norm else (None, None)
            o = self.attn.forward_rope(positions, q, k, v, rope, *norms, md)
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if rope is not None:
                q, k = rope(positions, q, k)
            o = self.attn(q, k, v, md)
        return self.o_proj(o.reshape(t, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter],
                                                       bias=getattr(cfg, "mlp_bias", False),
                                                       params_dtype=dtype)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size,
                                           bias=getattr(cfg, "mlp_bias", False), params_dtype=dtype)
        self.act = SiluAndMul(use_triton_ops=use_triton_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, qk_norm: bool, qkv_bias: bool,
                 use_triton_ops: bool = True, *, layer: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, dtype, qk_norm, qkv_bias, use_triton_ops,
                                        layer=layer)
        self.mlp = LlamaMLP(cfg, dtype, use_triton_ops)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, use_triton_ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, use_triton_ops)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None,
                md: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, md)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class PPMissingLayer(nn.Identity):
    """A module another pipeline stage holds: no parameters, never run."""


# Architectures whose model builds per pipeline stage (LlamaModel.build_stages) and whose
# loaders skip the other stages' tensors; the engine refuses pipeline parallelism for the rest.
PIPELINE_PARALLEL_ARCHITECTURES = frozenset({
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    # the families built on LlamaModel's stages (shoal/models/<family>.py)
    "CohereForCausalLM", "Gemma2ForCausalLM", "Glm4ForCausalLM", "Glm4MoeForCausalLM",
    "GraniteForCausalLM", "GraniteMoeForCausalLM", "MixtralForCausalLM", "Olmo2ForCausalLM",
    "Phi3ForCausalLM", "SmolLM3ForCausalLM", "Starcoder2ForCausalLM",
    # DeepSeek-V2 / V3 (and Kimi-K2): MLA and MoE layers on the same stages
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
    # pooling heads over LlamaModel's stages (shoal/models/llama_pooling.py: runner="pooling")
    "LlamaForSequenceClassification", "Qwen2ForSequenceClassification"})


class LlamaModel(nn.Module):
    # The whole stack, for subclasses that build their layers without build_stages (one
    # stage only).
    is_first = is_last = True
    start_layer: int = 0
    end_layer: int | None = None
    # EAGLE-3's auxiliary hidden states (record_aux); none recorded by default
    aux_layers: tuple[int, ...] = ()
    aux_route: AuxRoute | None = None  # which of them this stage records (and receives)
    aux_buffer: torch.Tensor

    def __init__(self, cfg: Any, dtype: torch.dtype, qk_norm: bool = False,
                 qkv_bias: bool = False, use_triton_ops: bool = True):
        super().__init__()
        self.build_stages(
            cfg, dtype,
            lambda i: LlamaDecoderLayer(cfg, dtype, qk_norm, qkv_bias, use_triton_ops, layer=i),
            lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops))

    def build_stages(self, cfg: Any, dtype: torch.dtype, layer: Callable[[int], nn.Module],
                     norm: Callable[[], nn.Module]) -> None:
        """This pipeline stage's part of the stack (the module docstring's rule): embed_tokens
        on the first stage, layer(i) for each layer of pp_layer_range, norm() on the last,
        PPMissingLayer in the place of the rest. Subclasses with layers of their own call it
        from their __init__ (after nn.Module's) and so build per stage too."""
        self.hidden_size, self.dtype = cfg.hidden_size, dtype
        self.is_first, self.is_last = pp_is_first(), pp_is_last()
        self.start_layer, self.end_layer = pp_layer_range(cfg.num_hidden_layers)
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
                             if self.is_first else PPMissingLayer())
        self.layers = nn.ModuleList(
            layer(i) if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(cfg.num_hidden_layers))
        self.norm = norm() if self.is_last else PPMissingLayer()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, md: Any,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None,
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states on the last stage; (hidden, residual) for the next stage
        on the others. A later stage takes the previous stage's (hidden, residual) as
        `intermediate`; without one (warm-up and profile runs) it starts from zeros.
        inputs_embeds: the first stage's input embeddings, when given (images in)."""
        residual: torch.Tensor | None
        if self.is_first and inputs_embeds is not None:
            hidden, residual = inputs_embeds, None
        elif self.is_first:
            hidden, residual = self.embed_tokens(input_ids), None
        elif intermediate is not None:
            hidden, residual = intermediate
        else:
            hidden = torch.zeros(input_ids.shape[0], self.hidden_size, dtype=self.dtype,
                                 device=input_ids.device)
            residual = torch.zeros_like(hidden)
        if self.aux_route is not None:
            hidden, residual = self._layers_recording_aux(positions, hidden, residual, md)
        else:
            for layer in self.layers[self.start_layer:self.end_layer]:
                hidden, residual = layer(positions, hidden, residual, md)
        if not self.is_last:
            assert residual is not None
            return hidden, residual
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def record_aux(self, layer_ids: tuple[int, ...], max_tokens: int) -> None:
        """EAGLE-3: every forward pass also writes the residual stream entering each layer
        of layer_ids (len(layers): the last layer's output) into aux_buffer, concatenated:
        [tokens, len(layer_ids) * hidden]. A fixed buffer, so CUDA graph replays fill it too.
        Pipeline parallelism: each stage records the layers it owns (aux_route.own, in
        layer_ids' order; shoal/distributed/stage_aux.py), which StageLink moves to stage 0."""
        self.aux_layers = tuple(layer_ids)
        num_layers, stages = len(self.layers), get_pp_world_size()
        ranges = [pp_layer_range(num_layers, s) for s in range(stages)]
        stage = 0 if stages == 1 else ranges.index((self.start_layer, self.end_layer))
        self.aux_route = aux_route(self.aux_layers, ranges, stage)
        self.aux_buffer = torch.zeros(max_tokens, len(self.aux_route.own) * self.hidden_size,
                                      dtype=self.dtype, device=next(self.parameters()).device)

    def _layers_recording_aux(self, positions: torch.Tensor, hidden: torch.Tensor,
                              residual: torch.Tensor | None, md: Any
                              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.end_layer is not None and self.aux_route is not None
        # each recorded residual stream straight into its columns (one kernel each)
        column = {layer: j for j, layer in enumerate(self.aux_route.own)}
        t, width = hidden.shape[0], self.hidden_size
        if column and t > self.aux_buffer.shape[0]:  # (eager only: graphs capture within it)
            self.aux_buffer = self.aux_buffer.new_zeros(t, self.aux_buffer.shape[1])
        for i in range(self.start_layer, self.end_layer + 1):
            if i in column:
                out = self.aux_buffer[:t, column[i] * width:(column[i] + 1) * width]
                if residual is None:
                    out.copy_(hidden)
                else:
                    torch.add(hidden, residual, out=out)
            if i < self.end_layer:
                hidden, residual = self.layers[i](positions, hidden, residual, md)
        return hidden, residual

    def owns(self, name: str) -> bool:
        """Whether the checkpoint tensor `name` (under model.) lands on this stage."""
        if name.startswith("model.layers."):
            i = int(name.split(".", 3)[2])
            return self.start_layer <= i < self.end_layer
        if name.startswith("model.embed_tokens."):
            return self.is_first
        if name.startswith("model.norm."):
            return self.is_last
        return True


class LlamaForCausalLM(nn.Module):
    qk_norm = False
    qkv_bias = False
    # as a pooling model (runner="pooling"): causal attention, the last token's state
    is_causal = True
    default_pooling_type = "LAST"
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__()
        self.config = hf_config
        self.hidden_size = hf_config.hidden_size
        self.model = self._build_model(hf_config, dtype, use_triton_ops)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        # Stage 0 samples (see the module docstring): it alone holds lm_head.
        self.lm_head = (ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype)
                        if pp_is_first() else PPMissingLayer())
        if self.tie_word_embeddings and pp_is_first():
            self.lm_head.weight = self.model.embed_tokens.weight

    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> nn.Module:
        """The decoder stack under `model.` (the checkpoint's prefix); subclasses swap it."""
        return LlamaModel(hf_config, dtype, self.qk_norm, self.qkv_bias, use_triton_ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        return self.model(input_ids, positions, attn_metadata)

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      attn_metadata: Any, intermediate: tuple[torch.Tensor, torch.Tensor] | None,
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Pipeline parallelism: this stage's layers, from the previous stage's (hidden,
        residual) (None on the first stage). Returns the final hidden states on the last
        stage, (hidden, residual) for the next stage on the others."""
        return self.model(input_ids, positions, attn_metadata, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers
                if not isinstance(layer, PPMissingLayer)]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads HF-named tensors; returns the names of the parameters that were filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            if get_pp_world_size() > 1 and not self._on_this_stage(name):
                continue  # another pipeline stage's tensor
            target, shard = packed_target(name, self.packed_modules_mapping)
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            load_tensor(param, tensor, shard)
            loaded.add(target)
        return loaded

    def _on_this_stage(self, name: str) -> bool:
        if name.startswith("lm_head."):
            return pp_is_first()
        return self.model.owns(name)

    def stage_tensors(self, weights: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint tensors this pipeline stage holds (all of them on one stage): for
        loaders that consume some tensors before load_weights' own check (MoE experts)."""
        one = get_pp_world_size() == 1
        return ((name, t) for name, t in weights if one or self._on_this_stage(name))


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
