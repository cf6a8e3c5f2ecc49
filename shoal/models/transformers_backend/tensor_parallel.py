"""Tensor parallelism for the Transformers backend, from the plan transformers ships with a
config (`base_model_tp_plan`: module-name patterns relative to the base model, "*" for a
layer number -> a style). Each nn.Linear the plan splits becomes shoal's column- or
row-parallel layer (their weight loaders take the whole checkpoint tensor and keep this
rank's slice); attention modules whose q/k/v projections are split see their local head
counts. Embeddings and the LM head stay whole on every rank (replicated), so the logits are
the same everywhere. With more ranks than KV heads (tensor_parallel_size a multiple of
num_key_value_heads) separate k_proj / v_proj projections are not split but each rank keeps
the one KV head its query heads read, as native models' QKVParallelLinear does.

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

from shoal.distributed.parallel_state import get_tp_world_size
from shoal.layers.linear import ColumnParallelLinear, RowParallelLinear, default_weight_loader

# style -> whether the layer's output is gathered back whole (ColumnParallelLinear)
COLUMN_STYLES = {"colwise": False, "colwise_rep": True, "colwise_gather_output": True}
# style -> whether the layer's input arrives whole (this rank slices it) (RowParallelLinear)
ROW_STYLES = {"rowwise": False, "rowwise_rep": True, "rowwise_split_input": True}
# weights stay whole on every rank: nothing to do (grad reductions do not apply here)
REPLICATED_STYLES = frozenset({"replicated_with_grad_allreduce", "replicate",
                               "embedding_rowwise", "embedding_colwise"})
# a column split (not gathered) of one of these splits attention heads
HEAD_PROJECTIONS = frozenset({"q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value"})
# the separate key and value projections (KV heads replicated over ranks when fewer than them)
KV_PROJECTIONS = frozenset({"k_proj", "v_proj"})
# attention-module attributes that count heads (divided on the ranks that split heads)
HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads")
KV_HEAD_ATTRIBUTES = ("num_key_value_heads", "num_kv_heads")


class SplitInputRowParallelLinear(RowParallelLinear):
    """Row-parallel layer whose input arrives whole on every rank: each keeps its slice."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.input_size_per_partition
        return super().forward(x.narrow(-1, self.tp_rank * n, n).contiguous())


class ReplicatedKVLinear(ColumnParallelLinear):
    """A k or v projection over more ranks than KV heads: each rank keeps, whole, the one KV
    head its query heads read (rank // replicas: a rank's query heads are consecutive and
    fall in one KV head's group)."""

    def __init__(self, linear: nn.Linear, kv_heads: int):
        tp = get_tp_world_size()
        self.head_rows = linear.out_features // kv_heads
        self.replicas = tp // kv_heads
        super().__init__(linear.in_features, self.head_rows * tp, bias=linear.bias is not None,
                         params_dtype=linear.weight.dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        head = self.tp_rank // self.replicas
        default_weight_loader(param, loaded.narrow(0, head * self.head_rows, self.head_rows))


@dataclass(frozen=True)
class TPPlan:
    """A config's plan as the backend applies it."""

    tp: int
    rules: dict[str, str]  # pattern -> style
    splits_heads: bool  # q/k/v projections split column-wise: attention runs local heads
    kv_heads: int | None = None  # the config's KV heads, when they are split
    kv_replicas: int = 1  # ranks holding each KV head (> 1: fewer KV heads than ranks)

    def style_of(self, module_name: str) -> str | None:
        for pattern, style in self.rules.items():
            if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), module_name):
                return style
        return None


def tp_plan_refusal(hf_config: Any, tp: int) -> str | None:
    """Why the backend cannot split the model over `tp` ranks (tp_plan's ValueError), from
    the config alone: the engine config asks before any rank starts."""
    try:
        tp_plan(hf_config, tp)
    except ValueError as e:
        return str(e)
    return None


def tp_plan(hf_config: Any, tp: int) -> TPPlan:
    """The config's plan for `tp` ranks; ValueError when it has none, names a style the
    backend does not know, or splits heads that do not divide by tp (KV heads may also be
    fewer than tp and divide it, through separate k_proj / v_proj)."""
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
    split = {p.rsplit(".", 1)[-1] for p, s in rules.items() if COLUMN_STYLES.get(s) is False}
    splits_heads = bool(split & HEAD_PROJECTIONS)
    if not splits_heads:
        return TPPlan(tp, rules, False)
    heads = getattr(hf_config, "num_attention_heads", None)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads

    def indivisible(field: str, n: object, extra: str = "") -> ValueError:
        return ValueError(f"the Transformers backend cannot run {_name(hf_config)} with "
                          f"tensor_parallel_size {tp}: its {field} ({n}) is not divisible by "
                          f"tensor_parallel_size ({tp}){extra}")

    if not isinstance(heads, int) or heads % tp:
        raise indivisible("num_attention_heads", heads)
    if not isinstance(kv_heads, int) or kv_heads < 1:
        raise indivisible("num_key_value_heads", kv_heads)
    if kv_heads % tp == 0:
        return TPPlan(tp, rules, True, kv_heads)
    if tp % kv_heads:
        raise indivisible("num_key_value_heads", kv_heads, " and does not divide it (KV "
                          "heads are replicated only over a multiple of them)")
    if not split & KV_PROJECTIONS or split & (HEAD_PROJECTIONS - KV_PROJECTIONS - {"q_proj"}):
        raise indivisible("num_key_value_heads", kv_heads, ", and its KV heads sit in a fused "
                          "projection, which shoal does not replicate per head")
    return TPPlan(tp, rules, True, kv_heads, tp // kv_heads)


def apply_tp_plan(model: nn.Module, plan: TPPlan) -> None:
    """Replaces the plan's linears of `model` (a transformers causal LM, an encoder's
    classifier, or a base model itself) by shoal's parallel layers (weights uninitialized:
    the checkpoint fills them); the attention modules whose q/k/v projections are split get
    local head counts (those that reshape by -1 need none; the backend's probe checks what
    each one really passes)."""
    base = model.base_model
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
            replicate = (plan.kv_replicas > 1 and COLUMN_STYLES.get(style) is False
                         and child in KV_PROJECTIONS)
            setattr(parent, child, ReplicatedKVLinear(module, plan.kv_heads or 0) if replicate
                    else _parallel(module, style))
        except ValueError as e:
            raise ValueError(f"{type(model).__name__}.{name}: {e}") from None
        if COLUMN_STYLES.get(style) is False and child in HEAD_PROJECTIONS:
            attention[id(parent)] = parent
    if plan.splits_heads:
        # local counts: heads / tp; KV heads / tp, or one where they are replicated (then a
        # rank's query heads form one group)
        for module in attention.values():
            for attrs, local in ((HEAD_ATTRIBUTES, lambda n: n // plan.tp),
                                 (KV_HEAD_ATTRIBUTES,
                                  lambda n: n * plan.kv_replicas // plan.tp),
                                 (("num_key_value_groups",), lambda n: n // plan.kv_replicas)):
                for attr in attrs:
                    value = getattr(module, attr, None)
                    if isinstance(value, int) and not isinstance(value, bool):
                        setattr(module, attr, local(value))


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
