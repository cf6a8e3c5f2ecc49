"""TransformersForCausalLM: any transformers decoder whose modeling code takes custom
attention functions, run by shoal (shoal/models/interface.py's CausalLM) with shoal's paged
attention in place of transformers' own (vLLM's Transformers modeling backend).

The transformers model does everything but attention: embeddings, norms, MLPs and MoE,
rotary, the LM head; where its modules compute a formula shoal has fused kernels for, they
run through those (checked on probe inputs at construction, names never trusted): sibling
linears of one input packed into one GEMM (packed_linear.py), RMSNorms and gated SiLU MLPs
(fused_modules.py), rotate-half rotary in fewer kernels (rotary.py). Each of its attention
modules gets one shoal paged layer (its KV cache and backend bound by the runner like any
native model's); the attention function of
attention.py writes the step's keys and values into it and attends through the backend.
A step's flattened tokens go in as one [1, T] sequence with position_ids = positions;
transformers builds no causal mask for an attention implementation it does not know, and
the paged backend applies causality (and sliding windows) per request.

With tensor_parallel_size > 1 the config's own tensor-parallel plan splits the linears
(tensor_parallel.py; with more ranks than KV heads each rank keeps the KV head its query
heads read); the probe then sees each rank's local heads, which its paged layers keep. With
pipeline_parallel_size > 1 the config's pipeline plan splits the base model into stages
(pipeline.py): each builds and loads only its decoder layers, stage 0 also the embedding and
the LM head, the last stage the final norm, and forward_stage passes activations as native
models' stages do. Under runner="pooling" (as_pooling_model's subclass) it is a decoder
embedder: no LM head is built, the pooling runner pools its final hidden states over packed
prompts (causal attention; encoder-only models run as encoder.py's classes). The
compatibility table refuses, before any rank starts, a tp or pp size the config's plans
cannot split.

CUDA graphs: the step's attention metadata reaches the paged layers through the step
context, so a captured step reads the graph's persistent buffers as a native model's layers
do; whether transformers' code for the architecture can be captured at all (no host syncs,
nothing frozen that changes from step to step) is found out at start-up on the captured
graphs themselves (check_graph_capture: worker/graph_check.py), and a model that fails runs
eagerly, said in one log line.

Not here yet: pooling with pp > 1 (refused for every model), soft-capped attention
in a pooling step (refused when built), pipeline stages with CUDA graphs (as for native
models: enforce_eager)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn

from shoal.distributed.parallel_state import get_pp_world_size, get_tp_world_size, pp_is_first
from shoal.layers.attention import Attention
from shoal.models.interface import PoolingModelBase
from shoal.models.transformers_backend.attention import (
    AttentionCall,
    probe_attention,
    step_context,
)
from shoal.models.transformers_backend.build import adopt, build_causal_lm
from shoal.models.transformers_backend.fused_modules import FusedModules, fuse_modules
from shoal.models.transformers_backend.logits import CausalLMHead
from shoal.models.transformers_backend.packed_linear import linear_inputs
from shoal.models.transformers_backend.pipeline import (
    StageSlice,
    drop_lm_head,
    pp_plan_refusal,
    split_stages,
)
from shoal.models.transformers_backend.rotary import shorten_rotary
from shoal.models.transformers_backend.support import check_supported
from shoal.models.transformers_backend.tensor_parallel import TPPlan, apply_tp_plan, tp_plan
from shoal.models.transformers_backend.weights import load_checkpoint

# Tokens of the construction-time probe pass (two, so code paths for single-token steps and
# for longer ones are not told apart by it).
_PROBE_TOKENS = 2


class TransformersForCausalLM(nn.Module):
    # transformers' parameters are the checkpoint's own, unfused
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {}
    # transformers' forward was not written for capture: the runner checks its CUDA graphs
    # against eager steps before serving with them (shoal/worker/graph_check.py)
    check_graph_capture: ClassVar[bool] = True

    def __init__(self, hf_config: Any, dtype: torch.dtype, *, use_triton_ops: bool = True):
        """use_triton_ops has no effect: the layers are transformers' (attention excepted)."""
        super().__init__()
        check_supported(hf_config)
        tp, pp = get_tp_world_size(), get_pp_world_size()
        plan = tp_plan(hf_config, tp) if tp > 1 else None  # (refused before anything is built)
        refusal = pp_plan_refusal(hf_config, pp)
        if refusal is not None:
            raise ValueError(refusal)
        # As a pooling model (runner="pooling": as_pooling_model's subclass) it needs no LM
        # head; with pipeline stages only this stage's modules are built.
        self.pooling = isinstance(self, PoolingModelBase)
        self.stage: StageSlice | None = None
        dropped: list[str] = []

        def prune(hf: nn.Module) -> None:
            if pp > 1:
                self.stage = split_stages(hf, hf_config)
                dropped.extend(self.stage.dropped)
            if self.pooling and hf.get_output_embeddings() is not None and pp_is_first():
                dropped.append(drop_lm_head(hf))

        hf = build_causal_lm(hf_config, dtype, torch.get_default_device(), prune)
        self._dropped = tuple(dropped)
        if plan is not None:
            apply_tp_plan(hf, plan)
        # ("model.layers.0...", "lm_head.weight")
        adopt(self, hf)
        self.config = hf_config
        self.hidden_size = int(hf_config.hidden_size)
        self.dtype = dtype
        self.architecture = type(hf).__name__
        out = getattr(hf.get_output_embeddings(), "weight", None)
        inp = getattr(hf.get_input_embeddings(), "weight", None)
        self.tie_word_embeddings = out is not None and out is inp
        head = not self.pooling and (self.stage is None or self.stage.is_first)
        self._head = CausalLMHead(hf) if head else None
        base = getattr(hf, hf.base_model_prefix)
        if self.stage is not None:
            self.stage.attach(base)
        device = next(hf.parameters()).device
        self.fused = FusedModules()
        with torch.no_grad(), linear_inputs(hf) as inputs:
            # (not inference mode: tensors it caches stay usable outside)
            calls = probe_attention(lambda: self._run(
                torch.zeros(_PROBE_TOKENS, dtype=torch.long, device=device),
                torch.arange(_PROBE_TOKENS, device=device)))
            if plan is None:  # (a tensor-parallel plan's linears are its own)
                self.fused = fuse_modules(hf, inputs)
        self.short_rotary = shorten_rotary([c.module for c in calls],
                                           next(hf.parameters()))
        if plan is not None:
            check_local_heads(calls, hf_config, plan, self.architecture)
        first, end = ((self.stage.start, self.stage.end) if self.stage is not None
                      else (0, getattr(hf_config, "num_hidden_layers", None)))
        self.paged_attention = nn.ModuleList(
            paged_layers(calls, hf_config, self.architecture, first, end,
                         pooling=self.pooling))
        self._layer_of = {id(c.module): layer for c, layer in zip(calls, self.paged_attention)}

    def train(self, mode: bool = True) -> TransformersForCausalLM:
        self.hf_model.train(mode)
        return super().train(mode)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states; on a pipeline stage before the last, (hidden, residual)
        for the next stage (pipeline.py)."""
        return self.forward_stage(input_ids, positions, attn_metadata, None)

    def forward_stage(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      attn_metadata: Any,
                      intermediate: tuple[torch.Tensor, torch.Tensor] | None,
                      ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Pipeline parallelism: this stage's layers from the previous stage's (hidden,
        residual) (None on the first stage), as native models' forward_stage."""
        with step_context(attn_metadata, self._layer_of):
            return self._run(input_ids, positions, intermediate)

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor,
             intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        base = getattr(self.hf_model, self.hf_model.base_model_prefix)
        if self.stage is not None:
            return self.stage.run(base, input_ids, positions, intermediate, self.dtype)
        out = base(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                   use_cache=False)
        return out[0][0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._head is None:
            raise ValueError(f"{self.architecture} has no LM head here (a pooling model, or a "
                             "pipeline stage after the first)")
        return self._head(hidden)

    def attention_layers(self) -> list[Attention]:
        return list(self.paged_attention)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        owns = (lambda key: not key.startswith(self._dropped)) if self._dropped else None
        return load_checkpoint(self.hf_model, weights, owns)


def paged_layers(calls: list[AttentionCall], hf_config: Any, arch: str, first: int = 0,
                 end: int | None = None, *, pooling: bool = False) -> list[Attention]:
    """One paged layer per attention module the probe saw, in call order, for decoder layers
    [first, end) (this pipeline stage's; end None: the config's count, if any); ValueError
    naming what the backend cannot do. pooling: the model embeds (runner="pooling")."""
    def refuse(reason: str) -> ValueError:
        return ValueError(f"the Transformers backend cannot run {arch}: {reason}")

    if not calls:
        raise refuse("its forward pass never called the attention interface")
    if len({id(c.module) for c in calls}) != len(calls):
        raise refuse("an attention module runs more than once per pass (layers sharing "
                     "attention would share one KV cache)")
    num_layers = None if end is None else end - first
    if num_layers is not None and len(calls) < num_layers:
        raise refuse(f"only {len(calls)} of its {num_layers} decoder layers call attention; "
                     "the others keep state (recurrent, convolution) the paged K/V cache "
                     "cannot hold")
    layers = []
    for i, c in enumerate(calls):
        if not c.is_causal:
            raise refuse("bidirectional (non-causal) attention"
                         + (" (an encoder whose config does not read as one: "
                            "support.is_encoder_only)"
                            if pooling else ""))
        if c.own_mask:
            raise refuse("its attention modules build masks of their own (dynamic or "
                         "prefix masks), which paged attention does not apply")
        if pooling and c.softcap:
            raise refuse("attention soft-capping, which a pooling step (packed prompts, no "
                         "KV cache) does not apply")
        if c.head_dim != c.value_dim:
            raise refuse(f"keys of {c.head_dim} and values of {c.value_dim} per head (a "
                         "paged layer keeps both at one head size)")
        if c.num_heads % c.num_kv_heads:
            raise refuse(f"{c.num_heads} query heads over {c.num_kv_heads} KV heads")
        # The module's attention soft-cap (Gemma 2) goes to its paged layer, which hands it
        # to the backend and refuses, when the runner binds it, a backend that cannot cap.
        layer = Attention(c.num_heads, c.num_kv_heads, c.head_dim,
                          sliding_window(c, hf_config, first + i), softcap=c.softcap)
        if c.scaling is not None:
            layer.scale = c.scaling
        layers.append(layer)
    return layers


def check_local_heads(calls: list[AttentionCall], hf_config: Any, plan: TPPlan,
                      arch: str) -> None:
    """Every attention call runs this rank's share of the query heads (all of them where the
    plan gathers q/k/v back whole): ValueError for modeling code that reshapes by head
    counts the split did not reach. (KV heads are not compared: configs of models without
    grouped-query attention may carry a num_key_value_heads their code never reads.)"""
    heads = getattr(hf_config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return
    share = plan.tp if plan.splits_heads else 1
    for c in calls:
        if c.num_heads * share != heads:
            raise ValueError(f"the Transformers backend cannot run {arch} with "
                             f"tensor_parallel_size {plan.tp}: {type(c.module).__name__} "
                             f"attends over {c.num_heads} query heads on a rank, not "
                             f"{heads // share} of its {heads}")


def sliding_window(call: AttentionCall, hf_config: Any, index: int) -> int | None:
    """The window the module passes (what transformers' flash-attention path applies), else
    the config's for a layer its layer_types call sliding (what its masks apply)."""
    if call.sliding_window:
        return call.sliding_window
    types = getattr(hf_config, "layer_types", None)
    layer = getattr(call.module, "layer_idx", index)
    window = getattr(hf_config, "sliding_window", None)
    if types and isinstance(layer, int) and layer < len(types) and window:
        return window if types[layer] == "sliding_attention" else None
    return None
