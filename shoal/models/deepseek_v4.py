"""DeepSeek-V4 (DeepseekV4ForCausalLM: deepseek-ai/DeepSeek-V4-Flash, -Pro), on the CPU path.

Per decoder layer, on hc_mult residual streams (Manifold-Constrained Hyper-Connections,
shoal/layers/hyper_connection.py): attention (shoal/layers/compressed_attention.py: a sliding
window on every layer, plus compressed entries on CSA / HCA layers as config.layer_types
says), then a mixture of experts: routed experts with a clipped SwiGLU (FusedMoE) picked by a
token-id hash on "hash_moe" layers or by sqrtsoftplus top-k on "moe" layers
(shoal/layers/moe/deepseek_v4_routing.py; the hash needs the step's input ids, threaded
through forward), plus one always-on shared expert (clipped as well).

Paged caches (attention_layers(): per decoder layer its sliding window's rows, then on CSA /
HCA layers the compressed entries and the compressors' inputs of the open groups;
shoal/layers/compressed_attention.py) fall in KV cache groups by table policy: the entries
keep the whole context (the full-attention tables: 1/m of a row a token), the window rows and
the open groups' inputs drop the blocks behind their windows (one sliding group per window
length: the attention's, m or 2m for CSA, m' for HCA). Their rows differ, so each group gets
a partition of the pool with pages of its own (shoal/worker/kv_pool_split.py): a token of
context costs only the entries' bytes (core/kv_cache_spec.py context_bytes_per_token).

Multi-token prediction (speculative_config method "mtp"): the checkpoint's `mtp.*` layers are
the drafter's (shoal/models/deepseek_v4_mtp.py), which reads the target's hyper-connection
streams: with it, forward returns the last layer's streams flattened [T, hc * D] instead of
the collapsed, normed state, and compute_logits collapses them first (output_streams).

Tensor parallelism: attention heads and output groups split over the ranks (the shared KV
row, compressors and indexer replicated: shoal/layers/compressed_attention.py), every expert's
intermediate dim (FusedMoE) and the shared expert's, one all-reduce after each; routing and
hyper-connection mixing are small and replicated.

Expert parallelism (enable_expert_parallel; shoal/layers/moe/layer.py): the routed experts are
split whole over the ranks, E / ep each, the rest as above. Inside tensor parallelism every
rank routes every token and runs the pairs of its own experts; the experts' parts and the
shared expert's partial sum are summed by DeepseekV4MoE's one all-reduce. Over data-parallel
replicas (DP+EP, tensor_parallel_size 1) each replica routes its own tokens (a hash layer
looks its experts up from the replica's own input ids) before FusedMoE's all-to-all sends
each pair to its expert's replica; attention, hyper-connections, routers and the shared
expert stay whole per replica, an idle replica's dummy pass is a one-token prefill into the
null block, and MTP layers split their experts likewise (shoal/worker/draft_lockstep.py).

On CUDA the attention and CSA indexer scores are Triton kernels that read the paged caches up
to each row's position, a row per query token: decodes, and the tokens of prefill chunks and
verify steps over their requests' tables (shoal/attention/ops/v4_decode_attention.py,
v4_index_scores.py, shoal/layers/span_rows.py); everything else runs as on the CPU, in plain
torch. A step of
decodes alone reads nothing on the host (shoal/layers/request_spans.py: the decodes' positions,
tables and slots on the device, fixed shapes masked per row), so the runner captures decode
steps in CUDA graphs (decode_graphs_only), one per batch size and table width
(decode_table_buckets_from: the decodes' work follows the width, so a step replays the
narrowest that holds its longest request, not max_model_len's); prefill chunks and verify
steps read their spans on the host and run eagerly. Not yet: quantized (FP8 / FP4)
checkpoints."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from shoal.distributed.parallel_state import tp_all_reduce
from shoal.layers.compressed_attention import CompressedAttention
from shoal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from shoal.layers.hyper_connection import HyperConnection, HyperHead
from shoal.layers.linear import ColumnParallelLinear, RowParallelLinear, load_tensor
from shoal.layers.moe.deepseek_v4_routing import ClippedSwiGLU, DeepseekV4Router
from shoal.layers.moe.layer import FusedMoE
from shoal.layers.norm import RMSNorm
from shoal.layers.paged_rows import PagedRows
from shoal.layers.request_spans import StepSpans
from shoal.models.deepseek_v4_weights import shoal_name
from shoal.models.expert_weights import load_expert_tensors

logger = logging.getLogger(__name__)


class ClippedMLP(nn.Module):
    """The shared expert: SwiGLU with the experts' clipping; this rank's slice of the
    intermediate dim, its partial sum left to the caller's all-reduce."""

    def __init__(self, hidden: int, inter: int, limit: float, dtype: torch.dtype):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, inter, params_dtype=dtype)
        self.up_proj = ColumnParallelLinear(hidden, inter, params_dtype=dtype)
        self.down_proj = RowParallelLinear(inter, hidden, reduce_results=False,
                                           params_dtype=dtype)
        self.act = ClippedSwiGLU(limit=limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(torch.cat([self.gate_proj(x), self.up_proj(x)], -1)))


class DeepseekV4MoE(nn.Module):
    def __init__(self, cfg: Any, layer: int, dtype: torch.dtype, use_triton_ops: bool = True):
        super().__init__()
        kind = cfg.mlp_layer_types[layer]
        if kind not in ("hash_moe", "moe"):
            raise ValueError(f"unknown DeepSeek-V4 MLP layer type {kind!r}")
        self.gate = DeepseekV4Router(cfg, hashed=kind == "hash_moe")
        inter, limit = cfg.moe_intermediate_size, cfg.swiglu_limit
        self.experts = FusedMoE(cfg.n_routed_experts, cfg.hidden_size, inter,
                                reduce_results=False, params_dtype=dtype,
                                use_triton_ops=use_triton_ops,
                                activation=ClippedSwiGLU(limit=limit))
        # transformers builds one shared expert of moe_intermediate_size
        self.shared_experts = ClippedMLP(cfg.hidden_size, inter, limit, dtype)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        return tp_all_reduce(self.experts(x, weights.to(x.dtype), ids) + self.shared_experts(x))


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, cfg: Any, layer: int, dtype: torch.dtype, use_triton_ops: bool = True):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = CompressedAttention(cfg, layer, dtype, use_triton_ops)
        self.mlp = DeepseekV4MoE(cfg, layer, dtype, use_triton_ops)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, use_triton_ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, use_triton_ops)
        self.attn_hc = HyperConnection(cfg, use_triton_ops)
        self.ffn_hc = HyperConnection(cfg, use_triton_ops)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
                step: StepSpans) -> torch.Tensor:
        """streams [T, hc, D] -> [T, hc, D]."""
        post, comb, x = self.attn_hc(streams)
        out = self.self_attn(positions, self.input_layernorm(x), step)
        streams = HyperConnection.merge(streams, out, post, comb)
        post, comb, x = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(x), input_ids)
        return HyperConnection.merge(streams, out, post, comb)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg: Any, dtype: torch.dtype, use_triton_ops: bool = True):
        super().__init__()
        self.hc_mult = cfg.hc_mult
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(cfg, i, dtype, use_triton_ops)
                                    for i in range(cfg.num_hidden_layers))
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, use_triton_ops)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                md: Any) -> torch.Tensor:
        """The last layer's streams [T, hc, D]."""
        step = StepSpans.of(md, positions)
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, positions, step)
        return streams

    def collapse(self, streams: torch.Tensor) -> torch.Tensor:
        """Streams [T, hc, D] -> the final (normed) hidden state [T, D]."""
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(nn.Module):
    # as a pooling model (runner="pooling"): causal attention, the last token's state
    is_causal = True
    default_pooling_type = "LAST"
    # nothing fused: checkpoint projections load one to one
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {}
    # CUDA graphs of decode steps only (worker/model_runner.py): why the others run eagerly
    decode_graphs_only: ClassVar[str] = (
        "its attention (shoal/layers/compressed_attention.py) reads a prefill chunk's or a "
        "verify step's request spans on the host; a step of decodes alone reads none")
    # A graph's decodes score (CSA's indexer) or attend (HCA) every compressed entry its
    # block tables could hold, masked per row (shoal/layers/paged_entries.py decode_index):
    # their work follows the tables' width. Decode graphs are captured per width, doubling
    # from this many tokens (below it the window and top-k dominate; CSA's 2048 tokens are
    # 512 entries, V4's index_topk), and a step replays the narrowest holding its longest
    # request (shoal/worker/model_graphs.py).
    decode_table_buckets_from: ClassVar[int] = 2048

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        super().__init__()
        self.config = hf_config
        self.hidden_size = hf_config.hidden_size
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = DeepseekV4Model(hf_config, dtype, use_triton_ops)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, dtype)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # An MTP drafter reads the streams (output_streams): forward then returns them
        self.streams_out = False

    def output_streams(self) -> None:
        """From now on forward returns the last layer's streams flattened [T, hc * D] (the
        hidden state an MTP drafter reads) and compute_logits collapses them first."""
        self.streams_out = True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        streams = self.model(input_ids, positions, attn_metadata)
        return streams.flatten(1) if self.streams_out else self.model.collapse(streams)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.streams_out:
            hidden = self.model.collapse(hidden.view(hidden.shape[0], self.model.hc_mult, -1))
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[PagedRows]:  # type: ignore[override]
        """Per decoder layer: its window's rows, then (CSA / HCA) its compressed entries and
        its compressors' inputs of the open groups."""
        return [p for layer in self.model.layers for p in layer.self_attn.paged_layers()]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        skipped = 0

        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            nonlocal skipped
            for name, tensor in weights:
                if "rotary_emb." in name:
                    continue
                target = shoal_name(name, self.config.num_hidden_layers)
                if target is None:
                    skipped += 1
                    continue
                yield target, tensor

        for name, tensor in load_expert_tensors(renamed(), params, loaded, type(self).__name__):
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in "
                                 f"{type(self).__name__}")
            load_tensor(param, tensor)
            loaded.add(name)
        if skipped:  # read by the MTP drafter when there is one (mtp_name)
            logger.info("skipped %d tensors of the multi-token-prediction layers (the MTP "
                        "drafter's, speculative_config method 'mtp')", skipped)
        return loaded
