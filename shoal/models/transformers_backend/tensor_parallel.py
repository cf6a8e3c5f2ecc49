"""Tensor parallelism for the Transformers backend, from the plan transformers ships with a
config (`base_model_tp_plan`: module-name patterns relative to the base model, "*" for a
layer number -> a style). Each nn.Linear the plan splits becomes shoal's column- or
row-parallel layer (their weight loaders take the whole checkpoint tensor and keep this
rank's slice); attention modules whose q/k/v projections are split see their local head
counts. Embeddings and the LM head stay whole on every rank (replicated), so the logits are
the same everywhere.

Styles: "colwise" splits output features (the next layer takes the shards); "colwise_rep"
and "colwise_gather_output" split them and gather the output back whole; "rowwise" splits
input features of a layer whose input is sharded and all-reduces the partial sums;
"rowwise_rep" and "rowwise_split_input" take a whole input and keep this rank's slice
first. Styles that leave weights whole (norms, embeddings) need nothing; any other style is
refused."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shoal.layers.linear import ColumnParallelLinear, RowParallelLinear

# style -> whether the layer's output is gathered back whole (ColumnParallelLinear)
COLUMN_STYLES = {"colwise": False, "colwise_rep": True, "colwise_gather_output": True}
# style -> whether the layer's input arrives whole (this rank slices it) (RowParallelLinear)
ROW_STYLES = {"rowwise": False, "rowwise_rep": True, "rowwise_split_input": True}
# weights stay whole on every rank: nothing to do (grad reductions do not apply here)
REPLICATED_STYLES = frozenset({"replicated_with_grad_allreduce", "replicate",
                               "embedding_rowwise", "embedding_colwise"})
# a column split (not gathered) of one of these splits attention heads
HEAD_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value"})
# attention-module attributes that count heads (divided on the ranks that split heads)
HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "num_kv_heads")


class SplitInputRowParallelLinear(RowParallelLinear):
    """Row-parallel layer whose input arrives whole on every rank: each keeps its slice."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.input_size_per_partition
        return super().forward(x.narrow(-1, self.tp_rank * n, n).contiguous())


@dataclass(frozen=True)
class TPPlan:
    """A config's plan as the backend applies it."""

    tp: int
    rules: dict[str, str]  # pattern -> style
    splits_heads: bool  # q/k/v projections split column-wise: attention runs local heads

    def style_of(self, module_name: str) -> str | None:
        for pattern, style in self.rules.items():
            if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), module_name):
                return style
        return None


def tp_plan(hf_config: Any, tp: int) -> TPPlan:
    """The config's plan for `tp` ranks; ValueError when it has none, names a style the
    backend does not know, or splits heads that do not divide by tp."""
    rules = dict(getattr(hf_config, "base_model_tp_plan", None) or {})
    if not any(s in COLUMN_STYLES or s in ROW_STYLES for s in rules.values()):
        raise ValueError(f"the Transformers backend cannot run {_name(hf_config)} with "
                         f"tensor_parallel_size {tp}: its config has no base_model_tp_plan "
                         "that splits linear layers (use tensor_parallel_size 1)")
    for pattern, style in rules.items():
        if not (style in COLUMN_STYLES or style in ROW_STYLES or style in REPLICATED_STYLES):
            raise ValueError(f"the Transformers backend cannot run {_name(hf_config)} with "
                             f"tensor_parallel_size {tp}: its base_model_tp_plan puts "
                             f"{pattern!r} in style {style!r}, which shoal does not apply "
                             f"(known: {', '.join(sorted([*COLUMN_STYLES, *ROW_STYLES]))})")
    splits_heads = any(COLUMN_STYLES.get(s) is False and p.rsplit(".", 1)[-1] in HEAD_PROJECTIONS
                       for p, s in rules.items())
    if splits_heads:
        heads = getattr(hf_config, "num_attention_heads", None)
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        for field, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
            if not isinstance(n, int) or n % tp:
                raise ValueError(f"the Transformers backend cannot run {_name(hf_config)} "
                                 f"with tensor_parallel_size {tp}: its {field} ({n}) is not "
                                 f"divisible by tensor_parallel_size ({tp})")
    return TPPlan(tp, rules, splits_heads)


def apply_tp_plan(model: nn.Module, plan: TPPlan) -> None:
    """Replaces the plan's linears of `model` (a transformers causal LM) by shoal's parallel
    layers (weights uninitialized: the checkpoint fills them); the attention modules whose
    q/k/v projections are split get local head counts (those that reshape by -1 need none;
    the backend's probe checks what each one really passes)."""
    base = getattr(model, model.base_model_prefix)
    matched = [(name, module, style) for name, module in base.named_modules()
               if (style := plan.style_of(name)) is not None]
    attention: dict[int, nn.Module] = {}
    for name, module, style in matched:
        if style in REPLICATED_STYLES:
            continue
        if type(module) is not nn.Linear:
            raise ValueError(f"{type(model).__name__}: the base_model_tp_plan splits {name} "
                             f"({type(module).__name__}) {style}; shoal splits nn.Linear "
                             "layers only")
        parent_name, _, child = name.rpartition(".")
        parent = base.get_submodule(parent_name)
        try:
            setattr(parent, child, _parallel(module, style))
        except ValueError as e:
            raise ValueError(f"{type(model).__name__}.{name}: {e}") from None
        if COLUMN_STYLES.get(style) is False and child in HEAD_PROJECTIONS:
            attention[id(parent)] = parent
    if plan.splits_heads:
        for module in attention.values():
            for attr in HEAD_ATTRIBUTES:
                value = getattr(module, attr, None)
                if isinstance(value, int) and not isinstance(value, bool):
                    setattr(module, attr, value // plan.tp)


def _parallel(linear: nn.Linear, style: str) -> nn.Module:
    bias = linear.bias is not None
    dtype = linear.weight.dtype
    with torch.device(linear.weight.device):
        if style in COLUMN_STYLES:
            return ColumnParallelLinear(linear.in_features, linear.out_features, bias=bias,
                                        gather_output=COLUMN_STYLES[style], params_dtype=dtype)
        cls = SplitInputRowParallelLinear if ROW_STYLES[style] else RowParallelLinear
        return cls(linear.in_features, linear.out_features, bias=bias, params_dtype=dtype)


def _name(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    return archs[0] if archs else repr(getattr(hf_config, "model_type", None))
