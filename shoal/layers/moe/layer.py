"""FusedMoE: the stacked expert weights of one MoE layer, their tensor-parallel loading, and
the choice between the Triton kernel and the PyTorch path.

Tensor parallelism splits every expert's intermediate dim across ranks, like the dense MLP's
column-parallel gate_up and row-parallel down projections: each rank computes a partial sum
of every routed expert's output and the partials are all-reduced (a no-op at world size 1).

Expert parallelism (enable_expert_parallel, built inside parallel_state.expert_parallel) splits
the experts instead: rank r of ep (= tp) ranks holds experts [r * E/ep, (r+1) * E/ep) whole.
Tokens stay replicated as under TP; each rank runs only the routed (token, expert) pairs of its
own experts (the others contribute nothing) and the same all-reduce sums the ranks' parts.

With data parallelism (DP+EP, data_parallel_size > 1 with enable_expert_parallel) the EP group
spans the data-parallel replicas, which hold different tokens: each rank routes its own tokens
and sends each (token, expert) pair to the expert's rank and back (all_to_all.py); the
replicas step in lockstep so that every rank joins each layer's exchange
(shoal/engine/dp_lockstep.py).

Experts may carry biases (gpt-oss: w13_bias split like the gate/up rows, w2_bias whole) and
another activation than SiLU-and-mul (activation.py). Under TP the down bias is added by rank
0 alone, as its partial sum is all-reduced; under EP each expert's owner adds its own.

LoRA on the experts (shoal/lora/expert_layers.py) sets `lora` to a hook the expert paths call
after each projection of the routed rows: lora.add(which, y, x, experts, tokens) adds, in
place, y += the delta of x through projection which ("w13" or "w2") of the rows' local
experts (an int or one per row) under the adapters of the rows' step tokens (None: row i is
token i). The Triton path hands it the down projection's input already scaled by the routing
weight, which its GEMM folds in (the delta is linear in it). Under DP+EP the token's slot
travels with its pairs (lora.dispatched) and the owner's experts take lora.for_rows(slots).

FP8 experts (a DeepSeek-V3 / Qwen3-FP8 checkpoint on the GPU fast path,
shoal/quantization/fast_path.py): `install_fp8` swaps the dense w13_weight / w2_weight for
float8_e4m3fn tensors beside their scales (w13_weight_scale, w2_weight_scale), and `quant`
(a triton_experts_fp8.FP8Experts) routes the forward to that file's grouped GEMMs. INT4
weight-only experts (GPTQ, AWQ, compressed-tensors W4A16) likewise: `install_int4` swaps them
for packed codes, scales and zero points (w13_qweight, w13_scales, w13_qzeros, w2_...) and
`quant` (a triton_experts_int4.Int4Experts) routes to triton_experts_int4.py. gpt-oss's MXFP4
experts (shoal/models/gpt_oss.py, where the GPU can run them packed): `install_mxfp4` swaps
them for the checkpoint's e2m1 blocks and e8m0 scales (w13_blocks, w13_scales, w2_...) and
`quant` (an mxfp4_experts.Mxfp4Experts) routes to triton_experts_mxfp4.py.

Built under a PackedExpertsPlan (deferred_stacks.py: the fast path's, gpt-oss's MXFP4), the
dense stacks are deferred: their shape without their memory, allocated by `materialize_dense`
only where the experts end up dense after all (the weight loader does it on a dense shard).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shoal.distributed.parallel_state import (
    ep_dispatch_group,
    get_ep_rank,
    get_ep_world_size,
    get_tp_rank,
    get_tp_world_size,
    tp_all_reduce,
)
from shoal.layers.linear import _divide, default_weight_loader
from shoal.layers.moe.activation import SILU, ExpertActivation
from shoal.layers.moe.all_to_all import all_to_all_experts
from shoal.layers.moe.deferred_stacks import (
    PackedExpertsPlan,
    current_plan,
    deferred_stack,
    materialize,
)
from shoal.layers.moe.shared_experts import SharedExperts
from shoal.layers.moe.torch_experts import experts_dense, experts_torch
from shoal.layers.ops.dispatch import use_triton

# Checkpoint projections: gate (w1) and up (w3) stack into w13, down is w2.
SHARD_IDS = ("w1", "w3", "w2")


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  use_triton_ops: bool = True, foreign_ids: bool = False, *,
                  w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                  activation: ExpertActivation = SILU, lora: Any = None) -> torch.Tensor:
    """foreign_ids: topk_ids may hold E = w13.shape[0] (another rank's expert under expert
    parallelism), which contributes nothing. The PyTorch path skips those pairs; the Triton
    and graph-safe dense paths run them on expert 0 with weight 0 (shapes stay routing-free)."""
    extra = dict(w13_bias=w13_bias, w2_bias=w2_bias, activation=activation, lora=lora)
    if use_triton(x, use_triton_ops):
        from shoal.layers.moe.triton_experts import experts_triton

        if foreign_ids:
            topk_ids, topk_weights = _mask_foreign(topk_ids, topk_weights, w13.shape[0])
        return experts_triton(x, w13, w2, topk_weights, topk_ids, **extra)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        if foreign_ids:
            topk_ids, topk_weights = _mask_foreign(topk_ids, topk_weights, w13.shape[0])
        return experts_dense(x, w13, w2, topk_weights, topk_ids, **extra)
    return experts_torch(x, w13, w2, topk_weights, topk_ids, **extra)


def _mask_foreign(topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                  num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pairs of ids >= num_experts become expert 0 with routing weight 0."""
    mine = topk_ids < num_experts
    return (torch.where(mine, topk_ids, 0),
            torch.where(mine, topk_weights, torch.zeros_like(topk_weights)))


class FusedMoE(nn.Module):
    """w13_weight [E, 2 * I / tp, H]: this rank's gate rows, then its up rows, per expert;
    w2_weight [E, H, I / tp]: this rank's columns of each down projection. With expert
    parallelism: w13_weight [E / ep, 2 * I, H], w2_weight [E / ep, H, I], this rank's
    experts whole (local expert i is global expert expert_start + i). has_bias adds
    w13_bias [E, 2 * I / tp] and w2_bias [E, H] (the local experts' under EP).
    packed: the experts are expected packed, so the dense stacks are deferred (None: the
    plan of the surrounding deferred_stacks.packed_experts_expected, if any)."""

    lora: Any = None  # a shoal.lora.expert_layers.ExpertLoRA when the engine serves adapters
    quant: Any = None  # FP8Experts / Int4Experts / Mxfp4Experts once install_* ran

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 reduce_results: bool = True, params_dtype: torch.dtype | None = None,
                 use_triton_ops: bool = True, *, has_bias: bool = False,
                 activation: ExpertActivation = SILU, packed: PackedExpertsPlan | None = None):
        super().__init__()
        self.activation = activation
        self.use_triton_ops = use_triton_ops  # the Triton kernel for CUDA tensors
        self.tp_size, self.tp_rank = get_tp_world_size(), get_tp_rank()
        self.num_experts = num_experts
        self.hidden_size = hidden_size  # (w13_weight is gone once INT4 experts are installed)
        self.ep_size, self.ep_rank = get_ep_world_size(), get_ep_rank()
        if self.ep_size > 1:
            if num_experts % self.ep_size:
                raise ValueError(
                    f"enable_expert_parallel: the number of experts ({num_experts}) is not "
                    f"divisible by the expert-parallel size ({self.ep_size}: the "
                    f"tensor_parallel_size, or the data_parallel_size under DP+EP)")
            self.local_num_experts = num_experts // self.ep_size
            self.inter, self.inter_rank = intermediate_size, 0  # experts whole
        else:
            self.local_num_experts = num_experts
            self.inter = _divide(intermediate_size, self.tp_size, "moe_intermediate_size")
            self.inter_rank = self.tp_rank
        self.expert_start = self.ep_rank * self.local_num_experts
        self.reduce_results = reduce_results
        self.packed_plan = packed if packed is not None else current_plan()
        stack = torch.empty if self.packed_plan is None else deferred_stack
        self.w13_weight = nn.Parameter(
            stack(self.local_num_experts, 2 * self.inter, hidden_size, dtype=params_dtype),
            requires_grad=False)
        self.w2_weight = nn.Parameter(
            stack(self.local_num_experts, hidden_size, self.inter, dtype=params_dtype),
            requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if has_bias:
            self.w13_bias = nn.Parameter(
                torch.empty(self.local_num_experts, 2 * self.inter, dtype=params_dtype),
                requires_grad=False)
            self.w2_bias = nn.Parameter(
                torch.empty(self.local_num_experts, hidden_size, dtype=params_dtype),
                requires_grad=False)
            self.w13_bias.weight_loader = self.weight_loader
            self.w2_bias.weight_loader = self.weight_loader
        # TP splits every expert: the ranks' partial outputs are summed, so one adds the bias.
        self.adds_down_bias = self.ep_size > 1 or self.tp_rank == 0
        # DP+EP: the group tokens are dispatched over (all-to-all), None otherwise.
        self.dispatch_group = ep_dispatch_group() if self.ep_size > 1 else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, expert_id: int,
                      shard_id: str) -> None:
        """One expert's full checkpoint projection: gate / up [I, H] (w1 / w3), down [H, I]
        (w2), or its bias (gate / up [I], down [H]); this rank's slice of the intermediate dim
        is copied into place. Under expert parallelism another rank's expert is skipped and a
        local one is copied whole."""
        if shard_id not in SHARD_IDS:
            raise ValueError(f"shard_id must be one of {SHARD_IDS}, got {shard_id!r}")
        materialize(param)  # a dense shard for a deferred stack: these experts stay dense
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert {expert_id} out of range [0, {self.num_experts})")
        local = expert_id - self.expert_start
        if not 0 <= local < self.local_num_experts:
            return  # another expert-parallel rank's expert
        start = self.inter_rank * self.inter
        if shard_id == "w2":
            whole = loaded.dim() == 1  # the down bias: H, nothing to split
            # this rank's columns: the intermediate dim, or of a packed FP8 part (its scale
            # groups, quantization/handles.py) as many as the target holds
            cols = param.shape[-1]
            default_weight_loader(param.data[local], loaded if whole else
                                  loaded.narrow(1, self.inter_rank * cols, cols))
            return
        offset = 0 if shard_id == "w1" else self.inter
        default_weight_loader(param.data[local].narrow(0, offset, self.inter),
                              loaded.narrow(0, start, self.inter))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor, shared: SharedExperts | None = None) -> torch.Tensor:
        """shared: the layer's shared experts (shared_experts.py), added to the routed sum
        before the all-reduce: inside the bf16 decode kernels where they run (dense experts
        and shared weights of one rank's slices, no LoRA, no expert parallelism), else
        through shared.run."""
        if self.dispatch_group is not None:  # DP+EP: this rank's tokens, all experts
            tags = None if self.lora is None else self.lora.dispatched(x.shape[0])
            out = all_to_all_experts(x, topk_weights, topk_ids, self.local_num_experts,
                                     self._run_local_experts, self.dispatch_group, tags)
            # (no all-reduce for the shared experts either: DP+EP runs TP = 1, PP = 1,
            # engine/compatibility.py)
            return out if shared is None else out + shared.run(x)
        foreign = self.ep_size > 1
        if foreign:  # global ids -> local ones; other ranks' experts -> local_num_experts
            local = topk_ids - self.expert_start
            mine = (local >= 0) & (local < self.local_num_experts)
            topk_ids = torch.where(mine, local, self.local_num_experts)
        lora = self.lora if self.lora is not None and self.lora.enabled() else None
        if shared is not None and self._takes_shared(x, shared, foreign, lora):
            out = self._experts(x, topk_weights, topk_ids, foreign, lora,
                                self.adds_down_bias, shared)
        else:
            out = self._experts(x, topk_weights, topk_ids, foreign, lora, self.adds_down_bias)
            out = out if shared is None else out + shared.run(x)
        return tp_all_reduce(out) if self.reduce_results else out

    def _takes_shared(self, x: torch.Tensor, shared: SharedExperts, foreign: bool,
                      lora: Any) -> bool:
        """Whether the routed experts' Triton kernels may run `shared` (experts_triton: in
        the decode launches at decode sizes, else added after the grouped GEMMs)."""
        return (self.quant is None and lora is None and not foreign
                and use_triton(x, self.use_triton_ops)
                and shared.chunks(x, self.w2_weight.shape[2]) > 0)

    def _experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 foreign: bool, lora: Any, down_bias: bool,
                 shared: SharedExperts | None = None) -> torch.Tensor:
        if shared is not None:  # (_takes_shared: dense, on the Triton kernels)
            from shoal.layers.moe.triton_experts import experts_triton

            return experts_triton(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                  shared=shared, **self._extras(down_bias))
        if self.quant is None:
            return fused_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                                 self.use_triton_ops, foreign_ids=foreign, lora=lora,
                                 **self._extras(down_bias))
        # FP8 / INT4 / MXFP4: always the Triton kernels (installed only where they run:
        # fast_path.py, gpt_oss.py)
        from shoal.layers.moe.mxfp4_experts import Mxfp4Experts
        from shoal.layers.moe.triton_experts_fp8 import experts_triton_fp8
        from shoal.layers.moe.triton_experts_int4 import Int4Experts, experts_triton_int4

        if foreign:
            topk_ids, topk_weights = _mask_foreign(topk_ids, topk_weights,
                                                   self.local_num_experts)
        if isinstance(self.quant, Mxfp4Experts):
            from shoal.layers.moe.triton_experts_mxfp4 import experts_triton_mxfp4

            run = experts_triton_mxfp4
        else:
            run = (experts_triton_int4 if isinstance(self.quant, Int4Experts)
                   else experts_triton_fp8)
        return run(x, self.quant, topk_weights, topk_ids, lora=lora, **self._extras(down_bias))

    def install_fp8(self, q: Any) -> None:
        """The experts from now on: q, a triton_experts_fp8.FP8Experts of this layer's shapes.
        Its tensors become buffers, not parameters: no weight update can refill them (they
        are refused, as for packed linears) and sleep keeps them at both levels."""
        e, two_i, h = self.w13_weight.shape
        if tuple(q.w13.shape) != (e, two_i, h) or tuple(q.w2.shape) != tuple(
                self.w2_weight.shape):
            raise ValueError(f"FP8 experts {tuple(q.w13.shape)} / {tuple(q.w2.shape)} do not "
                             f"fit the layer's {(e, two_i, h)} / {tuple(self.w2_weight.shape)}")
        for name, t in (("w13_weight", q.w13), ("w13_weight_scale", q.w13_scale),
                        ("w2_weight", q.w2), ("w2_weight_scale", q.w2_scale)):
            if hasattr(self, name):
                delattr(self, name)
            self.register_buffer(name, t)
        self.quant = q

    def install_int4(self, q: Any) -> None:
        """The experts from now on: q, a triton_experts_int4.Int4Experts of this layer's
        shapes (packed codes, scales, zero points)."""
        self._install_packed(q, "INT4", q.w13.codes, q.w2.codes)

    def install_mxfp4(self, q: Any) -> None:
        """The experts from now on: q, an mxfp4_experts.Mxfp4Experts of this layer's shapes
        (the checkpoint's e2m1 blocks and e8m0 scales)."""
        self._install_packed(q, "MXFP4", q.w13.blocks, q.w2.blocks)

    def install(self, q: Any) -> None:
        """install_mxfp4, install_int4 or install_fp8, by the type of q."""
        from shoal.layers.moe.mxfp4_experts import Mxfp4Experts

        if isinstance(q, Mxfp4Experts):
            self.install_mxfp4(q)
            return
        from shoal.layers.moe.triton_experts_int4 import Int4Experts

        (self.install_int4 if isinstance(q, Int4Experts) else self.install_fp8)(q)

    def materialize_dense(self) -> None:
        """The dense stacks' own memory where they were deferred (the experts stay dense)."""
        materialize(self.w13_weight)
        materialize(self.w2_weight)

    def _install_packed(self, q: Any, fmt: str, w13_store: torch.Tensor,
                        w2_store: torch.Tensor) -> None:
        """The dense w13_weight / w2_weight are dropped and q's tensors become buffers (as
        install_fp8's), once q's (experts, K, N) per projection fit the layer's."""
        e, two_i, h = self.w13_weight.shape
        i = self.w2_weight.shape[2]
        got = ((w13_store.shape[0], q.w13.in_features, q.w13.out_features),
               (w2_store.shape[0], q.w2.in_features, q.w2.out_features))
        if got != ((e, h, two_i), (e, i, h)):
            raise ValueError(f"{fmt} experts (E, K, N) {got} do not fit the layer's "
                             f"{((e, h, two_i), (e, i, h))}")
        del self.w13_weight, self.w2_weight
        for name, t in q.buffers().items():
            self.register_buffer(name, t)
        self.quant = q

    def _extras(self, down_bias: bool) -> dict:
        """fused_experts' bias and activation arguments."""
        return dict(w13_bias=self.w13_bias, w2_bias=self.w2_bias if down_bias else None,
                    activation=self.activation)

    def _run_local_experts(self, x: torch.Tensor, local_ids: torch.Tensor,
                           lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """Rows dispatched here, one (token, expert) pair each: the expert's unweighted
        output (all_to_all_experts applies the routing weights at the token's rank), with
        the LoRA delta of each row's adapter slot where slots came with them."""
        ones = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)
        lora = None if lora_slots is None else self.lora.for_rows(lora_slots)
        return self._experts(x, ones, local_ids[:, None], False, lora, True)
