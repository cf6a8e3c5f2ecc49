"""Tensor-parallel linear layers. Each parameter carries a `weight_loader` that takes the full
checkpoint tensor and copies this rank's shard into place, so model code never slices weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from shoal.distributed.parallel_state import (
    get_tp_rank,
    get_tp_world_size,
    tp_all_gather_last_dim,
    tp_all_reduce,
)
from shoal.layers.int4_cpu import Int4Weight, int4_linear
from shoal.layers.ops import dense_linear

_building_with_triton_ops = True  # what layers built now take (triton_ops_while_building)


@contextlib.contextmanager
def triton_ops_while_building(enabled: bool) -> Iterator[None]:
    """Dense layers built inside take `enabled` as their triton_gemv (an engine's
    use_triton_ops, for its model and its drafter's head alike: loader/build.py,
    spec_decode/factory.py). Not named use_triton_ops: the models pass that flag to the
    modules they build themselves; the dense layers take it from the engine's build."""
    global _building_with_triton_ops
    saved, _building_with_triton_ops = _building_with_triton_ops, enabled
    try:
        yield
    finally:
        _building_with_triton_ops = saved


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor_parallel_size ({d})")
    return n // d


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}")
    param.data.copy_(loaded)


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W split by rows (output features) across ranks."""

    lora: Any = None  # a shoal.lora.layers.LoRALayer when the engine serves adapters
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 gather_output: bool = False, params_dtype: torch.dtype | None = None):
        super().__init__()
        # decode rows on CUDA may take a Triton GEMV (ops/dense_linear.py)
        self.triton_gemv = _building_with_triton_ops
        self.tp_size, self.tp_rank = get_tp_world_size(), get_tp_rank()
        self.input_size = input_size
        self.output_size_per_partition = _divide(output_size, self.tp_size, "output size")
        self.gather_output = gather_output
        self.weight = nn.Parameter(
            torch.empty(self.output_size_per_partition, input_size, dtype=params_dtype),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader
        self.int4: Int4Weight | None = None  # set by int4_cpu.convert_linears
        self.quant: Any = None  # packed FP8/INT4 weights on CUDA (shoal/quantization/fast_path)
        if bias:
            self.bias = nn.Parameter(
                torch.empty(self.output_size_per_partition, dtype=params_dtype), requires_grad=False
            )
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = param.shape[0]
        default_weight_loader(param, loaded.narrow(0, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            y = self.quant(x)
            y = y if self.bias is None else y + self.bias
        elif self.int4 is not None and self.int4.takes(x):
            y = int4_linear(x, self.int4)
            y = y if self.bias is None else y + self.bias
        else:
            y = dense_linear.linear(x, self.weight, self.bias, self.triton_gemv)
        if self.lora is not None:
            self.lora.apply(x, y)
        return tp_all_gather_last_dim(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate_up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 params_dtype: torch.dtype | None = None):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias=bias, params_dtype=params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        if loaded.shape[0] != self.output_sizes[shard_id]:  # e.g. the fused tensor itself
            raise ValueError(f"projection {shard_id} of a fused layer has "
                             f"{self.output_sizes[shard_id]} rows; the tensor has "
                             f"{loaded.shape[0]}")
        shard = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        src = loaded.narrow(0, self.tp_rank * shard, shard)
        default_weight_loader(param.data.narrow(0, offset, shard), src)


def segmented_loader(segments: list[int], shards: dict[str, tuple[int, ...]] | None = None):
    """A weight loader for a parameter whose rows are several segments, each split across
    ranks (this rank holds its part of every segment, in order). A checkpoint tensor fills
    the run of segments its shard id names (all of them without one)."""
    tp, rank = get_tp_world_size(), get_tp_rank()

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        run = range(len(segments)) if shard_id is None else (shards or {})[shard_id]
        at = 0
        for i in run:
            part = _divide(segments[i], tp, "a projection segment")
            dst = sum(segments[:i]) // tp
            src = loaded.narrow(0, at + rank * part, part).reshape(
                part, *param.shape[1:])
            default_weight_loader(param.data.narrow(0, dst, part), src)
            at += segments[i]
    return load


class SegmentedColumnLinear(ColumnParallelLinear):
    """Column-parallel projection whose output is several segments, each split across ranks
    (Qwen3.5's q | k | v | z in-projection; one matmul)."""

    def __init__(self, input_size: int, segments: list[int],
                 shards: dict[str, tuple[int, ...]] | None = None, bias: bool = False,
                 params_dtype: torch.dtype | None = None):
        self._load = segmented_loader(segments, shards)
        super().__init__(input_size, sum(segments), bias=bias, params_dtype=params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: str | None = None) -> None:
        self._load(param, loaded, shard_id)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split across ranks (kv heads replicated when fewer
    than ranks)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, params_dtype: torch.dtype | None = None):
        tp = get_tp_world_size()
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp, "num_attention_heads")
        if num_kv_heads >= tp:
            self.num_kv_heads = _divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp, num_kv_heads, "tensor_parallel_size over kv heads")
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias=bias, params_dtype=params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            offset, size, rank = 0, q, self.tp_rank
            full = q * self.tp_size
        else:
            offset = q if shard_id == "k" else q + kv
            size, rank = kv, self.tp_rank // self.kv_replicas
            full = kv * self.tp_size // self.kv_replicas
        if loaded.shape[0] != full:  # e.g. the fused qkv tensor itself
            raise ValueError(f"the {shard_id} projection has {full} rows; the tensor has "
                             f"{loaded.shape[0]}")
        src = loaded.narrow(0, rank * size, size)
        default_weight_loader(param.data.narrow(0, offset, size), src)


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by columns (input features); partial sums are all-reduced."""

    lora: Any = None  # a shoal.lora.layers.LoRALayer (its delta joins the partial sums)
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 reduce_results: bool = True, params_dtype: torch.dtype | None = None):
        super().__init__()
        # decode rows on CUDA may take a Triton GEMV (ops/dense_linear.py)
        self.triton_gemv = _building_with_triton_ops
        self.tp_size, self.tp_rank = get_tp_world_size(), get_tp_rank()
        self.input_size_per_partition = _divide(input_size, self.tp_size, "input size")
        self.reduce_results = reduce_results
        self.weight = nn.Parameter(
            torch.empty(output_size, self.input_size_per_partition, dtype=params_dtype),
            requires_grad=False,
        )
        self.weight.weight_loader = self.weight_loader
        self.int4: Int4Weight | None = None  # set by int4_cpu.convert_linears
        self.quant: Any = None  # packed FP8/INT4 weights on CUDA (shoal/quantization/fast_path)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype), requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = param.shape[1]
        default_weight_loader(param, loaded.narrow(1, self.tp_rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            y, fused = self.quant(x), False
        elif self.int4 is not None and self.int4.takes(x):
            y, fused = int4_linear(x, self.int4), False
        else:
            # one rank on CUDA: the bias joins the matmul (no reduce between them; a launch less)
            fused = self.bias is not None and self.tp_size == 1 and x.is_cuda
            y = dense_linear.linear(x, self.weight, self.bias if fused else None,
                                    self.triton_gemv)
        if self.lora is not None:
            self.lora.apply(x, y)
        if self.reduce_results:
            y = tp_all_reduce(y)
        if self.bias is not None and not fused:
            y = y + self.bias
        return y


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole W on every rank (small projections whose output every rank
    needs in full, such as MLA's latent down-projections)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 params_dtype: torch.dtype | None = None):
        super().__init__()
        # decode rows on CUDA may take a Triton GEMV (ops/dense_linear.py), on one rank only:
        # every rank must get the same bits here (a sparse indexer's top-k reads them), and
        # each rank's launch tuner may pick another tile of near-equal time
        self.triton_gemv = _building_with_triton_ops and get_tp_world_size() == 1
        self.weight = nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=params_dtype),
                                     requires_grad=False)
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear.linear(x, self.weight, self.bias, self.triton_gemv)


# the layers whose decode rows may take a Triton GEMV (triton_gemv: triton_ops_while_building)
DENSE_LAYERS = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear)


def load_tensor(param: nn.Parameter, tensor: torch.Tensor, shard: str | int | None = None) -> None:
    """One checkpoint tensor into a parameter through its weight_loader (this rank's slice,
    the shard of a fused projection), in the parameter's dtype."""
    loader = getattr(param, "weight_loader", default_weight_loader)
    tensor = tensor.to(param.dtype)
    if shard is None:
        loader(param, tensor)
    else:
        loader(param, tensor, shard)


def packed_target(name: str, mapping: Mapping[str, tuple[str, str | int]]
                  ) -> tuple[str, str | int | None]:
    """A checkpoint tensor's parameter name and shard under a packed_modules_mapping
    ({"q_proj": ("qkv_proj", "q"), ...}): "...q_proj.weight" -> ("...qkv_proj.weight", "q");
    a name no entry matches is its own target, with no shard."""
    for src, (dst, shard) in mapping.items():
        if f".{src}." in name:
            return name.replace(f".{src}.", f".{dst}."), shard
    return name, None
