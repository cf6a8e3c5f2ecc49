"""compressed-tensors checkpoints (llm-compressor's output: quant_method
"compressed-tensors"), dequantized at load with the `compressed-tensors` package's own
config parser and decompressors.

The config's `config_groups` map module names (`targets`: exact names, "re:" regexes, or the
class name "Linear", here: every linear) to a scheme: weight bits, int or float, symmetric or
not, strategy (tensor, channel, group, block) and activation settings. `ignore` lists the
modules kept dense (often lm_head, attention in Kimi-K2 Thinking). Each scheme's storage
`format` (the scheme's own, else the config's, else inferred from the scheme):
- "float-quantized" (FP8 W8A8) and "int-quantized" (INT8 W8A8): `P.weight` float8_e4m3fn or
  int8 [N, K] with `P.weight_scale` (per tensor, per row [N, 1], or per block);
- "naive-quantized": the same, for weight-only schemes;
- "pack-quantized" (INT4 / INT8 weight-only, e.g. W4A16): `P.weight_packed` int32
  [N, ceil(K * bits / 32)] with the codes packed densely along the inputs, `P.weight_shape`
  ([N, K]), `P.weight_scale` [N, K / group_size] (group) or [N, 1] (channel), and for an
  asymmetric scheme `P.weight_zero_point`, packed along the outputs.
Activation qparams (`input_scale`, ...) and KV-cache scales (`k_scale`, `v_scale`) are
dropped: activations and the KV cache stay in the model's dtype. A scheme stored "dense"
(weights already fake-quantized in float) passes its weights through.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

SUPPORTED_FORMATS = ("float-quantized", "int-quantized", "pack-quantized", "naive-quantized")
DENSE_FORMATS = ("dense", "fakequant")
# Per-module tensors that only quantize activations or the KV cache: not needed to
# dequantize weights.
DROPPED = frozenset({"input_scale", "input_zero_point", "input_global_scale", "output_scale",
                     "output_zero_point", "k_scale", "v_scale", "q_scale"})
WEIGHT_PARAMS = frozenset({"weight", "weight_packed", "weight_scale", "weight_shape",
                           "weight_zero_point"})


def check_compressed_tensors_config(raw: dict[str, Any]) -> None:
    """Raises ValueError for a config the package cannot parse or shoal cannot dequantize."""
    CompressedTensorsLayout(raw).formats  # noqa: B018 (parses and checks every scheme)


@dataclass
class ModuleScheme:
    """The scheme a module was quantized with, and its storage format."""

    scheme: Any  # compressed_tensors.quantization.QuantizationScheme
    format: str

    @property
    def dense(self) -> bool:
        return self.format in DENSE_FORMATS

    @cached_property
    def compressor(self) -> Any:
        from compressed_tensors.compressors import BaseCompressor

        return BaseCompressor.get_value_from_registry(self.format)

    def param_names(self) -> tuple[str, ...]:
        """The tensors a module of this scheme stores (its first is the compressed weight)."""
        return tuple(self.compressor.compression_param_names(self.scheme))


class CompressedTensorsLayout:
    """A checkpoint's compressed-tensors config: which scheme each module has."""

    def __init__(self, raw: dict[str, Any]):
        import pydantic
        from compressed_tensors.quantization import QuantizationConfig as CTConfig

        for key in ("sparsity_config", "transform_config"):
            if raw.get(key):
                raise ValueError(f"compressed-tensors checkpoints with a {key} are not "
                                 "supported (only quantized weights are dequantized)")
        try:
            self.config = CTConfig.model_validate(raw)
        except pydantic.ValidationError as e:
            raise ValueError(f"the checkpoint's compressed-tensors quantization_config does "
                             f"not parse: {e}") from None
        self.ignore = list(self.config.ignore or [])
        self.groups = [ModuleScheme(s, self._format_of(s))
                       for s in self.config.config_groups.values()]

    @cached_property
    def formats(self) -> list[str]:
        return sorted({g.format for g in self.groups})

    def _format_of(self, scheme: Any) -> str:
        fmt = scheme.format or self.config.format
        if fmt in (None, "mixed-precision"):
            import torch.nn as nn
            from compressed_tensors.compressors.format import infer_module_format

            fmt = infer_module_format(nn.Linear, scheme)
        fmt = getattr(fmt, "value", fmt)
        if fmt not in SUPPORTED_FORMATS + DENSE_FORMATS:
            raise ValueError(f"compressed-tensors format {fmt!r} is not supported (supported: "
                             f"{', '.join(SUPPORTED_FORMATS)})")
        return fmt

    def is_ignored(self, module: str) -> bool:
        from compressed_tensors.utils.match import match_name

        return any(match_name(module, target) for target in self.ignore)

    def scheme_for(self, module: str) -> ModuleScheme | None:
        """The group whose targets name the module (exact or regex), else one targeting the
        class "Linear"; None when no group does."""
        from compressed_tensors.utils.match import match_name

        for group in self.groups:
            if any(match_name(module, t) for t in group.scheme.targets if not _is_class(t)):
                return group
        for group in self.groups:
            if "Linear" in group.scheme.targets:
                return group
        return None

    def decompress(self, module: str, group: ModuleScheme,
                   parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """float32 [N, K] from the module's compressed tensors (local names)."""
        # Float parts in float32: the package dequantizes in the scale's dtype.
        state = {k: v.to(torch.float32) if v.is_floating_point() and v.dtype.itemsize > 1
                 else v for k, v in parts.items()}
        out = group.compressor.decompress(state, group.scheme)
        weight = out["weight"]
        if weight.dim() != 2:
            raise ValueError(f"{module}: compressed-tensors decompressed a weight of shape "
                             f"{list(weight.shape)}; expected 2-D")
        return weight.to(torch.float32)


def _is_class(target: str) -> bool:
    """'Linear' (a class name) rather than 'lm_head' or 're:.*mlp.*' (module names)."""
    return not target.startswith("re:") and target[:1].isupper() and "." not in target
