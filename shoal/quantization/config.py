"""Which quantization a checkpoint uses, read from its config (`quantization_config`), and how
the user's `quantization` engine argument combines with it.

Torch-free: the server's frontend reads EngineArgs, which checks the argument's name here."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# What dequantizes at load on every device; each is one module of this package.
METHODS = ("fp8", "compressed-tensors", "gptq", "awq")
# Unpacked by the model itself (gpt-oss's MXFP4 experts: mxfp4.py): stored tensors stream as is.
MODEL_UNPACKED = ("mxfp4",)
# vLLM's names of the same checkpoints read by other kernels
ALIASES = {"gptq_marlin": "gptq", "awq_marlin": "awq", "compressed_tensors": "compressed-tensors"}
# Values of the `quantization` argument: the methods, and "gguf" for a .gguf file
USER_VALUES = (*METHODS, "gguf", *ALIASES)
GPTQ_BITS = (4, 8)  # 2- and 3-bit GPTQ pack values across int32 words: not read here
GPTQ_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class QuantizationConfig:
    """A checkpoint's quantization, as far as dequantizing its weights needs it."""

    quant_method: str  # one of METHODS
    # fp8: [rows, cols] of a weight_scale_inv block (None: per-tensor or per-channel scales)
    weight_block_size: tuple[int, int] | None = None
    activation_scheme: str = "dynamic"  # fp8: "static" checkpoints carry input_scale (unused)
    online: bool = False  # fp8 of a dense checkpoint: quantized here (quantization="fp8")
    # gptq / awq
    bits: int = 4
    group_size: int = -1  # -1: one group spans all inputs
    desc_act: bool = False  # gptq act-order: g_idx gives each input's group
    sym: bool = True
    zero_point: bool = True  # awq
    version: str = "gemm"  # awq kernel layout
    checkpoint_format: str = "gptq"  # gptq: "gptq" (v1, zeros stored minus one) or "gptq_v2"
    # compressed-tensors: the config as written, parsed by the package (compressed_tensors.py)
    raw: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.quant_method not in METHODS:
            raise ValueError(f"quant_method must be one of {', '.join(METHODS)} "
                             f"(got {self.quant_method!r})")
        if self.group_size != -1 and self.group_size < 1:
            raise ValueError(f"group_size must be -1 or >= 1 (got {self.group_size})")
        if self.quant_method == "gptq":
            if self.bits not in GPTQ_BITS:
                raise ValueError(f"GPTQ with {self.bits} bits is not supported (supported: "
                                 f"{', '.join(map(str, GPTQ_BITS))})")
            if self.checkpoint_format not in GPTQ_FORMATS:
                raise ValueError(f"GPTQ checkpoint_format {self.checkpoint_format!r} is not "
                                 f"supported (supported: {', '.join(GPTQ_FORMATS)})")
        if self.quant_method == "awq":
            if self.bits != 4:
                raise ValueError(f"AWQ with {self.bits} bits is not supported (supported: 4)")
            if self.version != "gemm":
                raise ValueError(f"AWQ version {self.version!r} is not supported (supported: "
                                 "gemm)")
            if not self.zero_point:
                raise ValueError("AWQ without zero points (zero_point: false) is not "
                                 "supported")
        if self.activation_scheme not in ("dynamic", "static"):
            raise ValueError(f"fp8 activation_scheme must be dynamic or static (got "
                             f"{self.activation_scheme!r})")

    def describe(self) -> str:
        """For the start-up log: 'gptq 4-bit, group 128, act-order'."""
        m = self.quant_method
        if m == "fp8":
            if self.online:
                return "fp8 (online: per-channel e4m3 of a dense checkpoint)"
            block = self.weight_block_size
            scales = f"block {block[0]}x{block[1]}" if block else "per-tensor/channel"
            return f"fp8 ({scales} scales, {self.activation_scheme} activations)"
        if m in ("gptq", "awq"):
            group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
            extra = ", act-order" if self.desc_act else ""
            if m == "gptq":
                extra += ", sym" if self.sym else ", asym"
                extra += f", {self.checkpoint_format}"
            return f"{m} {self.bits}-bit, {group}{extra}"
        schemes = ", ".join(sorted({_weight_scheme(g) for g in
                                    self.raw.get("config_groups", {}).values()}))
        return f"compressed-tensors {self.raw.get('format', '?')} ({schemes})"


def _weight_scheme(group: Any) -> str:
    """'int4 group 32 asym' from a compressed-tensors config group ('preset' for a preset's
    name mapped to its targets)."""
    w = group.get("weights") if isinstance(group, dict) else None
    if not w:
        return "preset"
    size = f" {w['group_size']}" if w.get("group_size") else ""
    asym = "" if w.get("symmetric", True) else " asym"
    return f"{w.get('type', 'int')}{w.get('num_bits', '?')} {w.get('strategy')}{size}{asym}"


def model_unpacked(hf_config: Any) -> bool:
    """The config names a format its model unpacks itself (MODEL_UNPACKED: gpt-oss's MXFP4
    experts), which detect_quantization leaves out."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is not None and not isinstance(raw, dict):
        raw = raw.to_dict()
    return bool(raw) and str(raw.get("quant_method", "")).lower() in MODEL_UNPACKED


def detect_quantization(hf_config: Any, folder: Path | None = None) -> QuantizationConfig | None:
    """The checkpoint's quantization: `quantization_config` of its config (a dict, or an
    object with to_dict), else an AutoGPTQ-era quantize_config.json beside it; None when
    dense. A method that cannot run here is refused by name."""
    raw = getattr(hf_config, "quantization_config", None)
    if raw is None and folder is not None and (folder / "quantize_config.json").is_file():
        raw = json.loads((folder / "quantize_config.json").read_text())
        raw.setdefault("quant_method", "gptq")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raw = raw.to_dict()
    if str(raw.get("quant_method", "")).lower() in MODEL_UNPACKED:
        return None
    return parse_quantization_config(raw)


def parse_quantization_config(raw: dict[str, Any]) -> QuantizationConfig:
    method = str(raw.get("quant_method", "")).lower()
    method = ALIASES.get(method, method)
    if method not in METHODS:
        raise ValueError(f"quantization method {method or raw!r} is not supported: shoal "
                         f"dequantizes {', '.join(METHODS)} checkpoints (and GGUF files)")
    if method == "fp8":
        block = raw.get("weight_block_size")
        if block is not None and (len(block) != 2 or min(block) < 1):
            raise ValueError(f"fp8 weight_block_size must be two positive ints (got {block})")
        return QuantizationConfig(
            "fp8", weight_block_size=tuple(block) if block else None,
            activation_scheme=raw.get("activation_scheme", "dynamic"))
    if method == "gptq":
        fmt = raw.get("checkpoint_format") or ("gptq" if not raw.get("is_marlin_format")
                                               else "marlin")
        return QuantizationConfig(
            "gptq", bits=int(raw.get("bits", 4)), group_size=int(raw.get("group_size", -1)),
            desc_act=bool(raw.get("desc_act", False)), sym=bool(raw.get("sym", True)),
            checkpoint_format=fmt)
    if method == "awq":
        return QuantizationConfig(
            "awq", bits=int(raw.get("bits", raw.get("w_bit", 4))),
            group_size=int(raw.get("group_size", raw.get("q_group_size", 128))),
            zero_point=bool(raw.get("zero_point", True)),
            version=str(raw.get("version", "gemm")).lower())
    from shoal.quantization.compressed_tensors import check_compressed_tensors_config

    check_compressed_tensors_config(raw)  # refuses what the package or shoal cannot read
    return QuantizationConfig("compressed-tensors", raw=raw)


def resolve_quantization(requested: str | None, detected: QuantizationConfig | None,
                         source: str) -> QuantizationConfig | None:
    """vLLM's rule: None takes the checkpoint's; the checkpoint's own method is fine; "fp8"
    of a dense checkpoint quantizes it at load (online); anything else conflicts."""
    if requested is None:
        return detected
    check_quantization_name(requested)
    method = ALIASES.get(requested, requested)
    have = detected.quant_method if detected is not None else None
    if method == have:
        return detected
    if have is None and method == "fp8":
        return QuantizationConfig("fp8", online=True)
    what = (f"its quantization_config says {have!r}" if have is not None
            else "it is not quantized (only 'fp8' quantizes a dense checkpoint at load)")
    raise ValueError(f"quantization={requested!r} conflicts with the checkpoint {source}: "
                     f"{what}")


def check_quantization_name(value: str | None) -> None:
    if value is not None and value not in USER_VALUES:
        raise ValueError(f"quantization must be one of {', '.join(USER_VALUES)} or None "
                         f"(auto: the checkpoint's own); got {value!r}")
