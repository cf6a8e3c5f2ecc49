"""How each format's tensors group into quantized linears: which checkpoint tensors are
parts of one (`classify`), when a linear has all its parts (`missing`), and how they become
its dense weight (`dequantize`). The stream over them is weights.py's; the arithmetic is
each format's module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from shoal.quantization.config import QuantizationConfig

DROP = "drop"  # classify: a tensor dequantized weights do not need (activation scales)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Scales of activations and of the KV cache: activations and the cache stay in the model's dtype.
_FP8_DROPPED = frozenset({"input_scale", "output_scale", "k_scale", "v_scale", "kv_scale",
                          "q_scale"})


@dataclass(frozen=True)
class Part:
    """One tensor of a quantized linear: model.layers.0.self_attn.q_proj + qweight."""

    module: str
    key: str


class LinearFormat(Protocol):
    def classify(self, name: str, tensor: torch.Tensor) -> Part | str | None:
        """A Part to gather, DROP, or None: an ordinary tensor passed through."""

    def missing(self, module: str, parts: dict[str, torch.Tensor]) -> list[str]:
        """What the module still lacks ([]: complete)."""

    def dequantize(self, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """The float32 [N, K] weight."""


def linear_format(qconfig: QuantizationConfig, keep_input_scales: bool = False) -> LinearFormat:
    """keep_input_scales: a static FP8 checkpoint's activation scales are parts of its
    linears (the GPU fast path runs FP8 activations with them)."""
    if qconfig.quant_method == "fp8":
        if qconfig.online:
            return OnlineFP8()
        static = keep_input_scales and qconfig.activation_scheme == "static"
        return FP8(qconfig.weight_block_size, static)
    if qconfig.quant_method == "gptq":
        return GPTQ(qconfig)
    if qconfig.quant_method == "awq":
        return AWQ(qconfig.group_size)
    return CompressedTensors(qconfig.raw)


def _split(name: str) -> tuple[str, str]:
    module, _, local = name.rpartition(".")
    return module, local


def _lacking(parts: dict[str, torch.Tensor], needed: tuple[str, ...]) -> list[str]:
    return [k for k in needed if k not in parts]


def _zero_bias(local: str, tensor: torch.Tensor) -> bool:
    """Some GPTQ/AWQ exports give every quantized linear a `bias` of zeros, the original
    layer had one or not (vLLM skips them too): dropped, so a bias-free model loads. A real
    bias is never all zeros; were it so, the model reports the parameter unfilled."""
    return local == "bias" and not bool(tensor.any())


class FP8:
    def __init__(self, block: tuple[int, int] | None, input_scales: bool = False):
        self.block = block
        self.input_scales = input_scales

    def classify(self, name: str, tensor: torch.Tensor) -> Part | str | None:
        module, local = _split(name)
        if local in ("weight_scale_inv", "weight_scale") or (
                local == "input_scale" and self.input_scales):
            return Part(module, local)
        if local in _FP8_DROPPED:
            return DROP
        if local == "weight" and tensor.dtype in FP8_DTYPES:
            return Part(module, local)
        return None

    def missing(self, module: str, parts: dict[str, torch.Tensor]) -> list[str]:
        need = [] if "weight" in parts else ["weight (float8)"]
        if "weight_scale_inv" not in parts and "weight_scale" not in parts:
            need.append("weight_scale_inv or weight_scale")
        if self.input_scales and "input_scale" not in parts:
            need.append("input_scale (activation_scheme static)")
        return need

    def dequantize(self, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        from shoal.quantization.fp8 import dequantize_fp8

        scale = parts.get("weight_scale_inv", parts.get("weight_scale"))
        return dequantize_fp8(parts["weight"], scale, self.block)


class OnlineFP8:
    """quantization="fp8" of a dense checkpoint: every linear weight through FP8 rounding.
    Linear weights are the 2-D `.weight`s other than embeddings, the LM head and MoE routers
    (vLLM keeps those unquantized too)."""

    _KEEP = ("embed_tokens.", "embeddings.", "wte.", "lm_head.", "mlp.gate.", "score.")

    def classify(self, name: str, tensor: torch.Tensor) -> Part | str | None:
        module, local = _split(name)
        if (local == "weight" and tensor.dim() == 2 and tensor.is_floating_point()
                and not any(k in name for k in self._KEEP)):
            return Part(module, local)
        return None

    def missing(self, module: str, parts: dict[str, torch.Tensor]) -> list[str]:
        return _lacking(parts, ("weight",))

    def dequantize(self, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        from shoal.quantization.fp8 import fp8_round_trip

        return fp8_round_trip(parts["weight"])


class GPTQ:
    def __init__(self, qconfig: QuantizationConfig):
        self.q = qconfig
        self.needed = ("qweight", "qzeros", "scales") + (("g_idx",) if qconfig.desc_act else ())

    def classify(self, name: str, tensor: torch.Tensor) -> Part | str | None:
        module, local = _split(name)
        if (local == "g_idx" and not self.q.desc_act) or _zero_bias(local, tensor):
            return DROP  # g_idx: sequential groups, recomputed from group_size
        if local in ("qweight", "qzeros", "scales", "g_idx"):
            return Part(module, local)
        return None

    def missing(self, module: str, parts: dict[str, torch.Tensor]) -> list[str]:
        return _lacking(parts, self.needed)

    def dequantize(self, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        from shoal.quantization.gptq import dequantize_gptq

        q = self.q
        return dequantize_gptq(parts["qweight"], parts["qzeros"], parts["scales"],
                               parts.get("g_idx"), q.bits, q.group_size,
                               v1_zeros=q.checkpoint_format == "gptq")


class AWQ:
    def __init__(self, group_size: int):
        self.group_size = group_size

    def classify(self, name: str, tensor: torch.Tensor) -> Part | str | None:
        module, local = _split(name)
        if _zero_bias(local, tensor):
            return DROP
        return Part(module, local) if local in ("qweight", "qzeros", "scales") else None

    def missing(self, module: str, parts: dict[str, torch.Tensor]) -> list[str]:
        return _lacking(parts, ("qweight", "qzeros", "scales"))

    def dequantize(self, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        from shoal.quantization.awq import dequantize_awq

        return dequantize_awq(parts["qweight"], parts["qzeros"], parts["scales"],
                              self.group_size)


class CompressedTensors:
    def __init__(self, raw: dict):
        from shoal.quantization.compressed_tensors import CompressedTensorsLayout

        self.layout = CompressedTensorsLayout(raw)

    def classify(self, name: str, tensor: torch.Tensor) -> Part | str | None:
        from shoal.quantization.compressed_tensors import DROPPED, WEIGHT_PARAMS

        module, local = _split(name)
        if local in DROPPED:
            return DROP
        if local not in WEIGHT_PARAMS:
            return None
        if local == "weight" and tensor.is_floating_point() and tensor.dtype not in FP8_DTYPES:
            return None  # a dense weight (ignored or untargeted module)
        group = self.layout.scheme_for(module)
        if group is None or self.layout.is_ignored(module):
            why = "ignores" if group is not None else "has no config group targeting"
            raise ValueError(f"checkpoint tensor {name!r} is quantized, but the "
                             f"quantization_config {why} module {module!r}")
        if group.dense:  # fake-quantized weights stored in float: their scales are unused
            return None if local == "weight" else DROP
        return Part(module, local)

    def missing(self, module: str, parts: dict[str, torch.Tensor]) -> list[str]:
        return _lacking(parts, self.layout.scheme_for(module).param_names())

    def dequantize(self, module: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.layout.decompress(module, self.layout.scheme_for(module), parts)
