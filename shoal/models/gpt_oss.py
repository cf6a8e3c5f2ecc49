"""gpt-oss (openai/gpt-oss-20b, -120b): a pre-norm decoder whose attention has biases on q/k/v/o
and a learned sink per head (a logit in the softmax's denominator with no value), layers
alternating a 128-token sliding window with full attention (config.layer_types), YaRN rotary,
and a mixture of experts on every layer: a router with a bias whose top-k logits are
softmaxed, experts with biases and a clamped SwiGLU (layers/moe/activation.py).

Checkpoints hold the experts stacked, gate and up interleaved along the intermediate dim
(even columns gate, odd up), either dequantized (gate_up_proj [E, H, 2I], down_proj [E, I, H],
transformers' layout) or as released, in MXFP4 (`*_blocks` / `*_scales` of the transposed
projections, shoal/layers/quantization/mxfp4.py). Both land in FusedMoE's stacked w13 (gate
rows, then up rows) and w2, split per tensor-parallel rank like any expert. Where the layer can
run them packed (CUDA with its Triton kernels: mxfp4_experts.packed_experts_problem), MXFP4
experts stay e2m1 codes and e8m0 scales in that order (FusedMoE.install_mxfp4, triton_experts_mxfp4.py);
elsewhere (the CPU, a rank's share of the down inputs off the 32-value blocks, ...) they are
unpacked into the model's dtype at load time, with one log line per reason. A layer of an
MXFP4 config that can keep them packed never allocates its dense stacks (deferred_stacks.py;
load_format="dummy" gives it random MXFP4 experts)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from shoal.distributed.parallel_state import get_tp_rank
from shoal.layers.attention import Attention
from shoal.layers.embedding import VocabParallelEmbedding
from shoal.layers.linear import QKVParallelLinear, RowParallelLinear, default_weight_loader
from shoal.layers.moe.activation import ExpertActivation
from shoal.layers.moe.deferred_stacks import PackedExpertsPlan
from shoal.layers.moe.layer import FusedMoE
from shoal.layers.moe.mxfp4_experts import (
    Mxfp4Experts,
    Mxfp4Weights,
    dequantize_mxfp4_experts,
    mxfp4_weights,
    packed_experts_problem,
)
from shoal.layers.moe.random_experts import random_mxfp4_experts
from shoal.layers.moe.router import routes_fused, topk_then_softmax
from shoal.layers.norm import RMSNorm
from shoal.layers.quantization.mxfp4 import BLOCK, BYTES_PER_BLOCK, dequantize_mxfp4
from shoal.layers.rotary import get_rope, rope_parameters
from shoal.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, layer_sliding_window
from shoal.quantization.config import model_unpacked

logger = logging.getLogger(__name__)

# model.layers.N.mlp.experts.gate_up_proj[_bias|_blocks|_scales], and down_proj's
_EXPERTS = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?$")
_PROJ = {"gate_up_proj": "w13", "down_proj": "w2"}  # FusedMoE's name of each projection
# MXFP4 experts expected packed: dense stacks deferred; dummy weights random MXFP4 experts
MXFP4_PLAN = PackedExpertsPlan("mxfp4", random_mxfp4_experts)


@dataclass
class _Mxfp4Loading:
    """One load pass's MXFP4 experts: each layer's packed projections until it has both, the
    layers that keep them packed, and why the others' are dense."""

    pending: dict[FusedMoE, dict[str, Mxfp4Weights]] = field(default_factory=dict)
    packed: list[FusedMoE] = field(default_factory=list)
    refused: dict[FusedMoE, str] = field(default_factory=dict)

    def refuse(self, moe: FusedMoE, why: str) -> None:
        """The layer runs dense: a projection already kept packed is unpacked into its
        dense stack (FusedMoE's rows already, one expert at a time)."""
        self.refused.setdefault(moe, why)
        moe.materialize_dense()
        for proj, w in self.pending.pop(moe, {}).items():
            param = getattr(moe, f"{_PROJ[proj]}_weight")
            for e in range(param.shape[0]):
                one = Mxfp4Weights(w.blocks[e:e + 1], w.scales[e:e + 1])
                param.data[e] = dequantize_mxfp4_experts(one, param.dtype)[0]


class GptOssAttention(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True, *,
                 layer: int):
        super().__init__()
        total_heads, total_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // total_heads
        bias = bool(getattr(cfg, "attention_bias", True))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, total_heads, total_kv,
                                          bias=bias, params_dtype=dtype)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, cfg.hidden_size, bias=bias,
                                        params_dtype=dtype)
        # This rank's heads' sinks (the checkpoint holds every head's).
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=dtype), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks
        theta, scaling = rope_parameters(cfg)
        self.rotary_emb = get_rope(self.head_dim, cfg.max_position_embeddings, theta, scaling,
                                   use_triton_ops=use_triton_ops)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              layer_sliding_window(cfg, layer))

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        default_weight_loader(param, loaded.narrow(0, get_tp_rank() * self.num_heads,
                                                   self.num_heads))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, md: Any) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        t = hidden.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.attn.fuses_rope:  # rotary and cache write in one kernel
            o = self.attn.forward_rope(positions, q, k, v, self.rotary_emb, None, None, md,
                                       sinks=self.sinks)
        else:
            q, k = self.rotary_emb(positions, q, k)
            o = self.attn(q, k, v, md, sinks=self.sinks)
        return self.o_proj(o.reshape(t, self.q_size))


class GptOssRouter(nn.Module):
    """Linear logits with a bias, the top k of them softmaxed (not a softmax over all experts
    then top-k). Replicated on every tensor-parallel rank, like TopKRouter."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, dtype: torch.dtype,
                 use_triton_ops: bool = True):
        super().__init__()
        self.top_k, self.use_triton_ops = top_k, use_triton_ops
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # CUDA decode steps: gate and routing in one launch (moe/gate_routing.py); other CUDA
        # logits: the routing in one launch (moe/topk_routing.py); others: torch.topk, softmax
        if routes_fused(x, self.weight, self.top_k, self.use_triton_ops, self.bias):
            from shoal.layers.moe.gate_routing import gate_routing

            return gate_routing(x, self.weight, self.top_k, "topk_then_softmax",
                                bias=self.bias)
        return topk_then_softmax(F.linear(x, self.weight, self.bias), self.top_k,
                                 self.use_triton_ops)


class GptOssMoE(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        super().__init__()
        self.router = GptOssRouter(cfg.hidden_size, cfg.num_local_experts,
                                   cfg.num_experts_per_tok, dtype, use_triton_ops)
        act = ExpertActivation("clamped_swiglu", alpha=getattr(cfg, "swiglu_alpha", 1.702),
                               limit=getattr(cfg, "swiglu_limit", 7.0))
        plan = MXFP4_PLAN if model_unpacked(cfg) else None  # (MXFP4: the one such format)
        self.experts = FusedMoE(cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size,
                                params_dtype=dtype, use_triton_ops=use_triton_ops,
                                has_bias=True, activation=act, packed=plan)
        if plan is not None and packed_experts_problem(self.experts) is not None:
            self.experts.materialize_dense()  # unpacked at load (the CPU, ...)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.experts(x, weights, ids)


class GptOssDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm residual forward over gpt-oss attention and experts."""

    def __init__(self, cfg: Any, dtype: torch.dtype, layer_idx: int,
                 use_triton_ops: bool = True):
        nn.Module.__init__(self)  # not Llama's __init__: it would allocate a dense MLP first
        self.self_attn = GptOssAttention(cfg, dtype, use_triton_ops, layer=layer_idx)
        self.mlp = GptOssMoE(cfg, dtype, use_triton_ops)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, use_triton_ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, use_triton_ops)


class GptOssModel(LlamaModel):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        nn.Module.__init__(self)  # Llama's would build dense layers
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(GptOssDecoderLayer(cfg, dtype, i, use_triton_ops)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops)


class GptOssForCausalLM(LlamaForCausalLM):
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
    }

    def _build_model(self, hf_config: Any, dtype: torch.dtype,
                     use_triton_ops: bool) -> nn.Module:
        return GptOssModel(hf_config, dtype, use_triton_ops)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Expert tensors (either layout) go into FusedMoE's stacked parameters; the rest
        load as in Llama."""
        loaded: set[str] = set()
        rest = super().load_weights(self._load_experts(weights, loaded))
        return loaded | rest  # super() consumed the generator, which filled `loaded`

    def _load_experts(self, weights: Iterable[tuple[str, torch.Tensor]],
                      loaded: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Loads the expert tensors among `weights` and yields every other one. An MXFP4
        projection loads once both its blocks and its scales have come by."""
        halves: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        mxfp4 = _Mxfp4Loading()
        for name, tensor in weights:
            m = _EXPERTS.match(name)
            if m is None:
                yield name, tensor
                continue
            prefix, proj, part = m[1], m[2], m[3] or ""
            moe = self._experts(prefix, name)
            if part in ("_blocks", "_scales"):
                pair = halves.setdefault((prefix, proj), {})
                pair[part] = tensor
                if len(pair) == 2:
                    del halves[(prefix, proj)]
                    self._load_mxfp4(moe, proj, pair["_blocks"], pair["_scales"], mxfp4)
                    loaded.add(_param_name(prefix, proj, bias=False))
                continue
            for e, t in enumerate(tensor.unbind(0)):
                # Biases are [out]; dense projections are stored [in, out] (transposed).
                self._load_expert(moe, proj, e, t if part else t.t(), bias=bool(part))
            loaded.add(_param_name(prefix, proj, bias=bool(part)))
        if halves:
            raise ValueError(f"MXFP4 expert tensors without their blocks or scales: "
                             f"{sorted('.'.join(k) for k in halves)}")
        self._finish_mxfp4(mxfp4)

    def _load_mxfp4(self, moe: FusedMoE, proj: str, blocks: torch.Tensor,
                    scales: torch.Tensor, mxfp4: _Mxfp4Loading) -> None:
        """One MXFP4 projection of every expert: kept packed where the layer can run it so
        (installed once both projections are in), else unpacked into the dense stack."""
        out, inp = self._expert_shape(proj)
        want = (self.config.num_local_experts, out, inp // BLOCK, BYTES_PER_BLOCK)
        if inp % BLOCK or tuple(blocks.shape) != want or tuple(scales.shape) != want[:3]:
            raise ValueError(f"expert {proj}_blocks {tuple(blocks.shape)} / _scales "
                             f"{tuple(scales.shape)}, expected {want} / {want[:3]}")
        why = mxfp4.refused.get(moe) or packed_experts_problem(moe)
        if why is None:
            try:
                mxfp4.pending.setdefault(moe, {})[proj] = _packed_rows(moe, proj, blocks,
                                                                       scales)
            except ValueError as err:
                why = str(err)
        if why is not None:
            mxfp4.refuse(moe, why)
            for e in range(moe.expert_start, moe.expert_start + moe.local_num_experts):
                # (another expert-parallel rank's experts: not worth unpacking)
                w = dequantize_mxfp4(blocks[e], scales[e], moe.w13_weight.dtype)
                self._load_expert(moe, proj, e, w, bias=False)
            return
        pending = mxfp4.pending[moe]
        if len(pending) == 2:
            del mxfp4.pending[moe]
            moe.install_mxfp4(Mxfp4Experts(pending["gate_up_proj"], pending["down_proj"]))
            mxfp4.packed.append(moe)

    def _finish_mxfp4(self, mxfp4: _Mxfp4Loading) -> None:
        """Layers with one projection packed and the other dense run dense; the log says
        which layers keep packed experts and why the others do not."""
        for moe in list(mxfp4.pending):
            mxfp4.refuse(moe, "only one of its two projections is MXFP4 in the checkpoint")
        if mxfp4.refused:
            names = {m: n for n, m in self.named_modules()}
            by_why: dict[str, list[FusedMoE]] = {}
            for moe, why in mxfp4.refused.items():
                by_why.setdefault(why, []).append(moe)
            for why, layers in by_why.items():
                logger.info("MoE experts of %d layer(s) (e.g. %s) kept dense, not MXFP4: %s",
                            len(layers), names.get(layers[0], "?"), why)
        if mxfp4.packed:
            nbytes = sum(m.quant.nbytes for m in mxfp4.packed)
            logger.info("%s x%d: %.1f MiB of packed experts", mxfp4.packed[0].quant.name,
                        len(mxfp4.packed), nbytes / 2**20)
            if mxfp4.packed[0].w13_blocks.is_cuda:
                torch.cuda.empty_cache()  # the dense experts' memory, for the KV cache

    def _experts(self, prefix: str, name: str) -> FusedMoE:
        try:
            moe = self.get_submodule(prefix)
        except AttributeError:
            moe = None
        if not isinstance(moe, FusedMoE):
            raise ValueError(f"checkpoint tensor {name!r} has no matching experts in "
                             f"{type(self).__name__}")
        return moe

    def _load_expert(self, moe: FusedMoE, proj: str, e: int, w: torch.Tensor,
                     bias: bool) -> None:
        """One expert's projection [out, in] (or bias [out]) in the checkpoint's order: gate_up
        rows interleaved (even gate, odd up), down whole."""
        out, inp = self._expert_shape(proj)
        if tuple(w.shape) != ((out,) if bias else (out, inp)):
            raise ValueError(f"expert {proj}{'_bias' if bias else ''} of shape "
                             f"{tuple(w.shape)}, expected {(out,) if bias else (out, inp)}")
        if proj == "gate_up_proj":
            param = moe.w13_bias if bias else moe.w13_weight
            w = w.to(param.dtype)
            moe.weight_loader(param, w[0::2], e, "w1")
            moe.weight_loader(param, w[1::2], e, "w3")
        else:
            param = moe.w2_bias if bias else moe.w2_weight
            moe.weight_loader(param, w.to(param.dtype), e, "w2")


    def _expert_shape(self, proj: str) -> tuple[int, int]:
        """(outputs, inputs) of one expert's whole projection in the checkpoint."""
        cfg = self.config
        return ((2 * cfg.intermediate_size, cfg.hidden_size) if proj == "gate_up_proj"
                else (cfg.hidden_size, cfg.intermediate_size))


def _packed_rows(moe: FusedMoE, proj: str, blocks: torch.Tensor,
                 scales: torch.Tensor) -> Mxfp4Weights:
    """The layer's share of a checkpoint projection (blocks [E, out, G, 16], scales
    [E, out, G]), still packed, on its device: its local experts; of gate_up this rank's gate
    rows (the even ones), then its up rows (the odd ones); of down this rank's input blocks.
    Copied one expert at a time (the loader streams the bytes as float32)."""
    start, size = moe.inter_rank * moe.inter, moe.inter
    if proj == "gate_up_proj":
        mine = torch.arange(start, start + size)
        rows, groups = torch.cat([2 * mine, 2 * mine + 1]), slice(None)
    else:  # packed_experts_problem checked that this rank's inputs are whole blocks
        rows, groups = slice(None), slice(start // BLOCK, (start + size) // BLOCK)
    first = blocks[0][rows][:, groups]
    local = range(moe.expert_start, moe.expert_start + moe.local_num_experts)
    device = moe.w13_weight.device
    out_b = torch.empty(len(local), first.shape[0], first.shape[1] * BYTES_PER_BLOCK,
                        dtype=torch.uint8, device=device)
    out_s = torch.empty(len(local), first.shape[0], first.shape[1], dtype=torch.uint8,
                        device=device)
    for i, e in enumerate(local):
        one = mxfp4_weights(blocks[e][rows][:, groups][None], scales[e][rows][:, groups][None])
        out_b[i], out_s[i] = one.blocks[0], one.scales[0]
    return Mxfp4Weights(out_b, out_s)


def _param_name(prefix: str, proj: str, bias: bool) -> str:
    return f"{prefix}.{'w13' if proj == 'gate_up_proj' else 'w2'}_{'bias' if bias else 'weight'}"
