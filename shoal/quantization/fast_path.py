"""The GPU fast path of quantized weights: which linear layers keep their FP8 or INT4 weights
packed on CUDA (and run shoal/layers/quantization's kernels), decided per layer at load.

Used by loader/build.py around a model's load, only on CUDA with a bfloat16 or float16 model
(the CPU path dequantizes at load, as it always has):
1. `FastPath.plan` (None: nothing to do, or SHOAL_QUANT_DEQUANT=1, the old dequantize-at-load
   path, for A/B runs);
2. `weights(stream)`: the checkpoint's stream with the linears it can pack left packed
   (handles.py's stand-ins); online FP8 (quantization="fp8" of a dense checkpoint) passes its
   dense weights through unrounded instead;
3. `loading(model)`: the `with` block around `model.load_weights`;
4. `finish(model)`: each layer that received all its rows packed gets `layer.quant`
   (methods.make_quant_linear picks its kernel; where none fits, the rows are dequantized into
   its dense weight), its dense weight freed. Online FP8, and dummy weights of a checkpoint
   config that names a scheme (benchmarks: random weights quantized by that scheme), quantize
   the dense linears here, on the device.

MoE experts (FusedMoE) in FP8 or INT4 stay packed the same way: a layer whose w13 and w2
arrived whole and packed gets `install_fp8` (shoal/layers/moe/triton_experts_fp8.py:
block-scaled or per-channel experts) or `install_int4` (triton_experts_int4.py: GPTQ, AWQ,
compressed-tensors W4A16); one that cannot (act-order INT4, a tensor-parallel slice off the
scale groups, a GPU without the kernel's instructions) is dequantized into its dense experts,
with a log line saying why. Online FP8 quantizes the dense experts at finish.

Where the config says the experts come packed (`experts_plan`), build.py builds the model's
FusedMoE layers with their dense stacks deferred (shoal/layers/moe/deferred_stacks.py): only
the packed buffers are ever allocated, and a layer that ends dense allocates its stacks then.
Dummy weights of an FP8 or 4-bit GPTQ / AWQ config are random packed experts of the config's
scheme (shoal/layers/moe/random_experts.py), drawn by loader/dummy.py."""

from __future__ import annotations

import logging
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
from torch import nn

from shoal import envs
from shoal.layers.moe.deferred_stacks import PackedExpertsPlan, materialize
from shoal.quantization.config import QuantizationConfig
from shoal.quantization.handles import LayerParts, PackedLoading, StandIns
from shoal.quantization.packed import (
    PackedLinear,
    awq_packed,
    ct_packed,
    dequantize_packed,
    fp8_packed,
    gptq_packed,
    quantize_fp8,
    quantize_int4,
)

logger = logging.getLogger(__name__)

DEQUANT_ENV = envs.SHOAL_QUANT_DEQUANT.name  # "1": every format dequantized at load (the old path)
# Linear weights online FP8 leaves dense (as formats.OnlineFP8 does on the CPU)
_KEEP_DENSE = ("embed_tokens.", "embeddings.", "wte.", "lm_head.", "mlp.gate.", "score.")


def packed_of(fmt: Any, q: QuantizationConfig, module: str,
              parts: dict[str, torch.Tensor]) -> PackedLinear | None:
    """A checkpoint linear's parts in the fast path's layout; None where it has no kernel
    here (8-bit weights, INT8 W8A8, unusual act-order): those are dequantized at load."""
    if q.quant_method == "fp8":
        scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
        return fp8_packed(parts["weight"], scale, q.weight_block_size, parts.get("input_scale"))
    if q.quant_method == "gptq":
        return gptq_packed(parts["qweight"], parts["qzeros"], parts["scales"],
                           parts.get("g_idx"), q.bits, q.group_size,
                           q.checkpoint_format == "gptq")
    if q.quant_method == "awq":
        return awq_packed(parts["qweight"], parts["qzeros"], parts["scales"], q.group_size)
    group = fmt.layout.scheme_for(module)
    return None if group is None or group.dense else ct_packed(group.scheme, group.format,
                                                               parts)


def dense_scheme(q: QuantizationConfig) -> Any:
    """How online FP8 and dummy weights quantize a dense weight: weight -> PackedLinear, or
    None (a compressed-tensors or 8-bit config: dummy weights stay dense)."""
    if q.quant_method == "fp8":
        block = None if q.online else q.weight_block_size
        return lambda w: quantize_fp8(w, block)
    if q.quant_method in ("gptq", "awq") and q.bits == 4:
        sym = q.sym if q.quant_method == "gptq" else False
        return lambda w: quantize_int4(w, q.group_size, sym)
    return None


def expert_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The FusedMoE layers that can hold packed experts and do not yet, by name."""
    return {name: m for name, m in model.named_modules()
            if hasattr(m, "install_fp8") and getattr(m, "quant", None) is None}


def fast_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The shoal linear layers (a `quant` slot) that run as layers, by name."""
    return {name: m for name, m in model.named_modules()
            if hasattr(m, "quant") and not getattr(m, "weight_only", False)
            and isinstance(getattr(m, "weight", None), nn.Parameter) and m.weight.dim() == 2}


@dataclass
class FastPath:
    qconfig: QuantizationConfig
    dtype: torch.dtype
    device: torch.device
    dummy: bool = False
    stand_ins: StandIns = field(init=False)
    _loading: PackedLoading | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.stand_ins = StandIns(self.dtype)

    @classmethod
    def plan(cls, qconfig: QuantizationConfig | None, dtype: torch.dtype,
             device: torch.device | str, dummy: bool = False,
             allow_cpu: bool = False) -> FastPath | None:
        """allow_cpu: tests, with the Triton kernels under TRITON_INTERPRET=1."""
        device = torch.device(device)
        if qconfig is None or envs.SHOAL_QUANT_DEQUANT.get():
            return None
        if device.type != "cuda" and not allow_cpu:
            return None
        if device.type == "cuda" and dtype not in (torch.bfloat16, torch.float16):
            logger.info("quantized weights: a %s model dequantizes them at load (the GPU "
                        "kernels take bfloat16 or float16 activations)", dtype)
            return None
        return cls(qconfig, dtype, device, dummy)

    def experts_plan(self) -> PackedExpertsPlan | None:
        """What this load's FusedMoE layers can expect: packed experts (so their dense
        stacks are deferred), with the random ones of a dummy load; None where the experts
        come dense (online FP8, 8-bit GPTQ) or have no kernel on this device."""
        from shoal.layers.moe.random_experts import random_fp8_experts, random_int4_experts

        q = self.qconfig
        random: Any = None
        if q.online:
            return None
        if q.quant_method == "fp8":
            kind, random = "fp8", partial(random_fp8_experts, block=q.weight_block_size)
        elif q.quant_method in ("gptq", "awq"):
            if q.bits != 4:
                return None
            kind = "int4"
            random = partial(random_int4_experts, group=q.group_size,
                             sym=q.sym if q.quant_method == "gptq" else False)
        else:  # compressed-tensors: dummy weights stay dense (dense_scheme)
            kind = ct_packed_kind(q)
            if kind is None:
                return None
        if kernel_problem(kind, self.device) is not None:
            return None
        return PackedExpertsPlan(kind, random if self.dummy else None)

    def weights(self, stream: Any) -> Any:
        """The stream to load (a dummy load has none)."""
        with_packer = getattr(stream, "with_packer", None)
        return stream if with_packer is None else with_packer(self._pack)

    def _pack(self, fmt: Any, module: str, parts: dict[str, torch.Tensor]) -> Any:
        if self.qconfig.online:  # quantized on the device by finish
            return parts["weight"].to(self.dtype)
        packed = packed_of(fmt, self.qconfig, module, parts)
        return None if packed is None else self.stand_ins.make(module, packed)

    def loading(self, model: nn.Module) -> Any:
        if self.dummy:
            return nullcontext()
        self._loading = PackedLoading(model, self.stand_ins, set(fast_layers(model).values()),
                                      set(expert_layers(model).values()))
        return self._loading

    @torch.no_grad()
    def finish(self, model: nn.Module) -> dict[str, int]:
        """Layers packed per kernel (and "dense": packed rows a layer could not run)."""
        untaken = self.stand_ins.untaken()
        self.stand_ins.release()
        if untaken:
            raise ValueError(f"{len(untaken)} quantized linear(s) (e.g. {untaken[0]!r}) never "
                             f"reached a weight loader; set {DEQUANT_ENV}=1 to dequantize at "
                             "load")
        counts: Counter[str] = Counter()
        bytes_packed = 0
        received = self._loading.parts if self._loading is not None else {}
        for layer, lp in received.items():
            complete = not lp.mixed and bool(lp.present.bool().all())
            packed = lp.packed()
            q = make(packed, self.device) if complete else None
            if q is None:
                rows = lp.present.bool().view(-1)
                layer.weight.data[rows] = dequantize_packed(packed)[rows].to(layer.weight.dtype)
                counts["dense (no kernel for this layer)"] += 1
                continue
            bytes_packed += self._install(layer, q)
            counts[q.name] += 1
        scheme = dense_scheme(self.qconfig) if (self.qconfig.online or self.dummy) else None
        if scheme is not None:
            for name, layer in fast_layers(model).items():
                if layer in received or any(k in f"{name}." for k in _KEEP_DENSE):
                    continue
                q = make(scheme(layer.weight.data), self.device)
                if q is not None:
                    bytes_packed += self._install(layer, q)
                    counts[q.name] += 1
        bytes_packed += self._finish_experts(model, counts)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the dense weights' memory, for the KV cache
        if counts:
            logger.info("quantized linears on %s: %s; %.1f MiB of packed weights",
                        self.device, ", ".join(f"{n} x{c}" for n, c in sorted(counts.items())),
                        bytes_packed / 2**20)
        self._loading = None
        return dict(counts)

    def _finish_experts(self, model: nn.Module, counts: Counter[str]) -> int:
        """FP8 / INT4 experts installed (or dequantized, logged); their bytes."""
        loading = self._loading
        stacks: dict[nn.Module, dict[str, Any]] = {}
        for (layer, which), lp in (loading.expert_parts if loading else {}).items():
            stacks.setdefault(layer, {})[which] = lp
        refused = dict(loading.refused) if loading else {}
        nbytes = 0
        for layer, lps in stacks.items():
            why = refused.get(layer) or experts_problem(lps, self.device)
            q = None
            if why is None:
                try:
                    q = packed_experts(lps["w13"], lps["w2"])
                except ValueError as e:
                    why = str(e)
            if q is None:
                refused[layer] = why
                for which, lp in lps.items():
                    dequantize_expert_rows(getattr(layer, f"{which}_weight"), lp)
                continue
            install_experts(layer, q)
            nbytes += q.nbytes
            counts[q.name] += 1
        scheme = dense_scheme(self.qconfig) if (self.qconfig.online or self.dummy) else None
        if scheme is not None:
            nbytes += self._quantize_dense_experts(model, counts, refused, set(stacks), scheme)
        names = {m: n for n, m in model.named_modules()}
        kinds = dict(loading.expert_kinds) if loading else {}
        default = "int4" if self.qconfig.quant_method in ("gptq", "awq") else "fp8"
        for (kind, why), layers in _by_reason(refused, kinds, default).items():
            counts[f"dense experts ({why})"] += len(layers)
            logger.info("MoE experts of %d layer(s) (e.g. %s) kept dense, not %s: %s",
                        len(layers), names.get(layers[0], "?"), kind.upper(), why)
        return nbytes

    def _quantize_dense_experts(self, model: nn.Module, counts: Counter[str],
                                refused: dict[nn.Module, str], done: set[nn.Module],
                                scheme: Any) -> int:
        """Online FP8 (per channel) and dummy weights (the config's blocks or groups): dense
        experts quantized on the device by `scheme` (dense_scheme), one expert at a time."""
        kind = "fp8" if self.qconfig.quant_method == "fp8" else "int4"
        nbytes = 0
        for layer in expert_layers(model).values():
            if layer in done or layer in refused:
                continue
            why = kernel_problem(kind, self.device)
            if why is not None:
                refused[layer] = why
                continue
            stack = [_stack([scheme(w) for w in getattr(layer, p).data])
                     for p in ("w13_weight", "w2_weight")]
            try:
                q = packed_experts(*stack)
            except ValueError as e:
                refused[layer] = str(e)
                continue
            install_experts(layer, q)
            nbytes += q.nbytes
            counts[q.name] += 1
        return nbytes

    def _install(self, layer: nn.Module, q: Any) -> int:
        layer.quant = q
        w = layer.weight
        layer.weight = nn.Parameter(torch.empty(0, dtype=w.dtype, device=w.device),
                                    requires_grad=False)
        return q.nbytes


def make(packed: PackedLinear, device: torch.device) -> Any:
    from shoal.layers.quantization.methods import make_quant_linear

    return make_quant_linear(packed, device)


# ---- FP8 and INT4 experts ---------------------------------------------------------------------

def experts_problem(lps: dict[str, LayerParts], device: torch.device) -> str | None:
    """Why an expert stack's received parts cannot run packed (None: they can)."""
    if set(lps) != {"w13", "w2"}:
        return "only one of the two projections arrived packed"
    if any(lp.mixed or not bool(lp.present.bool().all()) for lp in lps.values()):
        return "some experts' shards arrived dense"
    if lps["w13"].kind != lps["w2"].kind:
        return "the two projections are packed in different formats"
    return kernel_problem(lps["w13"].kind, device)


def kernel_problem(kind: str, device: torch.device) -> str | None:
    from shoal.layers.quantization.methods import fp8_supported, int4_supported

    if kind == "fp8" and not fp8_supported(device):
        return "no FP8 tensor cores on this GPU"
    if kind == "int4" and not int4_supported(device):
        return "the W4A16 kernel needs compute capability 8.0"
    return None


def packed_experts(w13: LayerParts, w2: LayerParts) -> Any:
    """The experts' run-time form from the two stacks' parts: triton_experts_fp8.FP8Experts
    or triton_experts_int4.Int4Experts; ValueError: why not."""
    if w13.kind == "int4":
        from shoal.layers.moe.triton_experts_int4 import Int4Experts, int4_weights

        return Int4Experts(*(int4_weights(lp.parts["codes"], lp.parts["scale"],
                                          lp.parts["zero"], lp.group, lp.in_features)
                             for lp in (w13, w2)))
    return fp8_experts(w13, w2)


def install_experts(layer: nn.Module, q: Any) -> None:
    from shoal.layers.moe.triton_experts_int4 import Int4Experts

    (layer.install_int4 if isinstance(q, Int4Experts) else layer.install_fp8)(q)


def fp8_experts(w13: LayerParts, w2: LayerParts) -> Any:
    """triton_experts_fp8.FP8Experts from the two stacks' parts; ValueError: why not."""
    from shoal.layers.moe.triton_experts_fp8 import make_fp8_experts

    return make_fp8_experts(w13.parts["weight"], w13.parts["scale"], w13.group,
                            w2.parts["weight"], w2.parts["scale"], w2.group,
                            w13.parts.get("input_scale"), w2.parts.get("input_scale"))


def dequantize_expert_rows(param: torch.Tensor, lp: LayerParts) -> None:
    """The rows packed shards filled, dequantized into the dense expert stack, one expert at
    a time (a whole stack in float32 would be several times its size)."""
    materialize(param)  # (deferred while the layer was expected packed)
    for e in range(param.shape[0]):
        rows = lp.present[e].bool().view(-1)
        if bool(rows.any()):
            one = PackedLinear(lp.kind, lp.in_features, lp.group,
                               {n: t[e] for n, t in lp.parts.items()}, lp.perm)
            param.data[e][rows] = dequantize_packed(one)[rows].to(param.dtype)


def ct_packed_kind(q: QuantizationConfig) -> str | None:
    """compressed-tensors: "int4" or "fp8" where a config group is stored in a form the
    expert kernels take (4-bit pack-quantized ints, 8-bit float-quantized floats); None."""
    from shoal.quantization.compressed_tensors import CompressedTensorsLayout

    kinds = set()
    for group in CompressedTensorsLayout(q.raw).groups:
        w = group.scheme.weights
        if w is None or group.dense:
            continue
        if group.format == "pack-quantized" and w.type == "int" and w.num_bits == 4:
            kinds.add("int4")
        elif group.format == "float-quantized" and w.type == "float" and w.num_bits == 8:
            kinds.add("fp8")
    return "int4" if "int4" in kinds else next(iter(kinds), None)


def _stack(packed: list[PackedLinear]) -> LayerParts:
    """Per-expert PackedLinears (one scheme) as one stack's LayerParts."""
    p = packed[0]
    parts = {n: torch.stack([q.parts[n] for q in packed]) for n in p.parts}
    return LayerParts(p.kind, p.group, p.in_features, 1, parts)


def _by_reason(refused: dict[nn.Module, str], kinds: dict[nn.Module, str],
               default: str) -> dict[tuple[str, str], list[nn.Module]]:
    """Refused layers by (packed kind, why)."""
    out: dict[tuple[str, str], list[nn.Module]] = {}
    for layer, why in refused.items():
        out.setdefault((kinds.get(layer, default), why), []).append(layer)
    return out
