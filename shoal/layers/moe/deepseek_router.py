"""DeepSeek-V2 / V3 expert routing, as transformers' DeepseekV2TopkRouter and
DeepseekV3TopkRouter compute it.

V2: softmax over all experts, then top-k ("greedy"), or top-k among the experts of the
`topk_group` groups whose best expert scores highest ("group_limited_greedy"); the k weights are
multiplied by routed_scaling_factor and never renormalized (transformers ignores
norm_topk_prob for V2; every released V2 checkpoint sets it false).

V3 ("noaux_tc"): sigmoid scores; the choice uses the scores plus e_score_correction_bias, a
group scoring the sum of its two best biased scores, `topk_group` groups kept, top-k among
their experts; the weights are the unbiased scores of the chosen experts, optionally
renormalized (norm_topk_prob), then multiplied by routed_scaling_factor.

Both compute the logits and every step after them in float32 (transformers keeps gate.weight
in float32); the weights are rounded to the activation dtype only at the end. CUDA logits
route in one Triton launch (shoal/layers/moe/deepseek_routing_kernel.py) where the model's
use_triton_ops allows; other tensors keep route_v2 / route_v3."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.layers.linear import default_weight_loader
from shoal.layers.moe.router import routes_on_kernel
from shoal.layers.ops.dispatch import use_triton

V2_METHODS = ("greedy", "group_limited_greedy")
KERNEL_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the kernel's weights


def _infer_version(cfg: Any) -> int:
    method = getattr(cfg, "topk_method", None)
    if method == "noaux_tc" or getattr(cfg, "scoring_func", None) == "sigmoid":
        return 3
    if method in V2_METHODS:
        return 2
    model_type = getattr(cfg, "model_type", None)
    if model_type in ("deepseek_v2", "deepseek_v3"):
        return int(model_type[-1])
    if model_type == "deepseek_v32":  # V3's routing
        return 3
    raise ValueError(f"cannot tell the DeepSeek routing version of {model_type!r} "
                     f"(topk_method={method!r}): pass version=2 or version=3")


def _group_mask(group_scores: torch.Tensor, topk_group: int, group_size: int) -> torch.Tensor:
    """[T, G] group scores -> [T, E] bool mask of the experts in each row's topk_group best
    groups."""
    idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, idx, 1)
    t, g = group_scores.shape
    return mask.unsqueeze(-1).expand(t, g, group_size).reshape(t, g * group_size).bool()


def route_v2(logits: torch.Tensor, top_k: int, topk_method: str, n_group: int,
             topk_group: int, routed_scaling_factor: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits [T, E] -> (float32 weights [T, k], int64 ids [T, k])."""
    scores = logits.softmax(dim=-1, dtype=torch.float32)
    if topk_method == "group_limited_greedy" and topk_group < n_group:
        t, e = scores.shape
        group_scores = scores.view(t, n_group, e // n_group).max(dim=-1).values
        keep = _group_mask(group_scores, topk_group, e // n_group)
        scores = scores.masked_fill(~keep, 0.0)
    weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return weights * routed_scaling_factor, ids


def route_v3(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
             topk_group: int, renormalize: bool, routed_scaling_factor: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 logits [T, E], float32 bias [E] -> (float32 weights [T, k], int64 ids [T, k])."""
    scores = logits.sigmoid()
    choice = scores + bias
    if topk_group < n_group:
        t, e = choice.shape
        group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
        keep = _group_mask(group_scores, topk_group, e // n_group)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


class DeepseekRouter(nn.Module):
    """The gate of a DeepSeek MoE layer: `weight` [E, H] (and, for V3,
    `e_score_correction_bias` [E], always float32), replicated on every tensor-parallel rank,
    named as in the checkpoints (model.layers.N.mlp.gate.*).

    params_dtype is the gate weight's dtype, float32 by default as transformers keeps it; a
    bf16 weight gives the same routing for a bf16 checkpoint (it is widened to float32 for the
    projection) at the cost of a cast per step. version: 2 or 3; None reads it from the
    config (topk_method / scoring_func, else model_type). use_triton_ops: CUDA logits route
    in one Triton launch (the model's switch; off keeps the torch code)."""

    def __init__(self, cfg: Any, params_dtype: torch.dtype | None = None, *,
                 version: int | None = None, use_triton_ops: bool = True):
        super().__init__()
        self.use_triton_ops = use_triton_ops
        self.version = _infer_version(cfg) if version is None else version
        if self.version not in (2, 3):
            raise ValueError(f"version must be 2 or 3, got {self.version}")
        self.num_experts = int(cfg.n_routed_experts)
        self.top_k = int(cfg.num_experts_per_tok)
        self.n_group = int(getattr(cfg, "n_group", None) or 1)
        self.topk_group = int(getattr(cfg, "topk_group", None) or self.n_group)
        scale = getattr(cfg, "routed_scaling_factor", None)
        self.routed_scaling_factor = 1.0 if scale is None else float(scale)
        self.renormalize = bool(getattr(cfg, "norm_topk_prob", False))
        method = getattr(cfg, "topk_method", None)
        scoring = getattr(cfg, "scoring_func", None)
        if self.version == 2:
            self.topk_method = method or "greedy"
            if self.topk_method not in V2_METHODS or scoring not in (None, "softmax"):
                raise ValueError(f"DeepSeek-V2 routing supports softmax scoring with "
                                 f"topk_method in {V2_METHODS}, got {scoring!r} / {method!r}")
            grouped = self.topk_method == "group_limited_greedy"
        else:
            self.topk_method = "noaux_tc"
            if method not in (None, "noaux_tc") or scoring not in (None, "sigmoid"):
                raise ValueError(f"DeepSeek-V3 routing is sigmoid scoring with noaux_tc, got "
                                 f"{scoring!r} / {method!r}")
            grouped = True
        self._check(grouped)
        self.weight = nn.Parameter(
            torch.empty(self.num_experts, int(cfg.hidden_size),
                        dtype=params_dtype or torch.float32), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        if self.version == 3:
            self.e_score_correction_bias = nn.Parameter(
                torch.zeros(self.num_experts, dtype=torch.float32), requires_grad=False)
            self.e_score_correction_bias.weight_loader = default_weight_loader

    def _check(self, grouped: bool) -> None:
        e, k = self.num_experts, self.top_k
        if not 1 <= k <= e:
            raise ValueError(f"num_experts_per_tok {k} must be in [1, n_routed_experts={e}]")
        if not grouped:
            return
        g, kg = self.n_group, self.topk_group
        if e % g or not 1 <= kg <= g:
            raise ValueError(f"n_group {g} must divide n_routed_experts {e} and topk_group {kg} "
                             f"must be in [1, n_group]")
        if k > kg * (e // g):
            raise ValueError(f"num_experts_per_tok {k} exceeds the {kg * (e // g)} experts of "
                             f"the topk_group={kg} groups kept")
        if self.version == 3 and e // g < 2 and kg < g:
            raise ValueError("noaux_tc scores a group by its two best experts: each group "
                             "needs at least 2")

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids int64 [T, k])."""
        logits = self.logits(x)
        if routes_on_kernel(logits, self.top_k, self.use_triton_ops) \
                and x.dtype in KERNEL_OUT_DTYPES:
            from shoal.layers.moe.deepseek_routing_kernel import deepseek_routing

            v3 = self.version == 3
            return deepseek_routing(
                logits, self.top_k, self.topk_method, self.n_group, self.topk_group,
                self.renormalize and v3, self.routed_scaling_factor,
                self.e_score_correction_bias.float() if v3 else None, out_dtype=x.dtype)
        if self.version == 2:
            weights, ids = route_v2(logits, self.top_k, self.topk_method, self.n_group,
                                    self.topk_group, self.routed_scaling_factor)
        else:
            weights, ids = route_v3(logits, self.e_score_correction_bias.float(), self.top_k,
                                    self.n_group, self.topk_group, self.renormalize,
                                    self.routed_scaling_factor)
        return weights.to(x.dtype), ids

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 [T, E]: at decode sizes on CUDA in one launch (gate_logits.py), else the
        float32 GEMM."""
        if use_triton(x, self.use_triton_ops):
            from shoal.layers.moe.gate_logits import fits_gate_kernel, gate_logits

            if fits_gate_kernel(x, self.weight):
                return gate_logits(x, self.weight)
        return F.linear(x.float(), self.weight.float())

    def extra_repr(self) -> str:
        return (f"version={self.version}, experts={self.num_experts}, top_k={self.top_k}, "
                f"groups={self.topk_group}/{self.n_group}, method={self.topk_method}, "
                f"renormalize={self.renormalize and self.version == 3}, "
                f"scale={self.routed_scaling_factor}")
