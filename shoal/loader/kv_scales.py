"""The KV-cache scales a checkpoint may carry, taken out of its weight stream for the
attention layers (an FP8 KV cache stores k / k_scale and v / v_scale: attention/kv_quant.py).

Names, as vLLM reads them (the module is the attention block, `model.layers.3.self_attn`, or
the attention layer under it, `...self_attn.attn`):
- `<module>.k_scale`, `<module>.v_scale` (llm-compressor / compressed-tensors, FP8 exports);
- `<module>.kv_scale`: one scale for both (older FP8 exports);
- `<module>.k_proj.output_scale`, `<module>.v_proj.output_scale` (older compressed-tensors),
  `<module>.k_proj.k_scale`, `<module>.v_proj.v_scale` (ModelOpt).
`<module>.q_scale` (a query scale, for FP8 attention math shoal does not do) is dropped. The
scales leave the stream before the model's load_weights and the quantized formats' own
streams see it, so no model or format needs to know them; the scales apply whatever
kv_cache_dtype is (an "auto" cache never reads them)."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

logger = logging.getLogger(__name__)

WeightsFn = Callable[[], Iterator[tuple[str, torch.Tensor]]]

_SCALE = re.compile(r"^(?P<module>.+?)(?:\.(?P<proj>[kv])_proj\.(?:output_scale|[kv]_scale)"
                    r"|\.(?P<which>k|v|kv|q)_scale)$")


@dataclass
class KVScales:
    """Per checkpoint module name, its K and V scales (filled as the weights stream)."""

    k: dict[str, float] = field(default_factory=dict)
    v: dict[str, float] = field(default_factory=dict)

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Records `name` if it is a KV scale (or a query scale, dropped); False otherwise."""
        m = _SCALE.match(name)
        if m is None:
            return False
        which = m["proj"] or m["which"]
        if which == "q":
            return True
        if tensor.numel() > 1:  # per-head scales: the largest never saturates more
            logger.info("%s has %d values: its largest serves the whole tensor", name,
                        tensor.numel())
        value = float(tensor.float().max())
        if which in ("k", "kv"):
            self.k[m["module"]] = value
        if which in ("v", "kv"):
            self.v[m["module"]] = value
        return True

    def of(self, module: str) -> tuple[float | None, float | None]:
        """The scales of an attention layer named `module`: its own, else its parent's."""
        parent = module.rpartition(".")[0]
        return (self.k.get(module, self.k.get(parent)), self.v.get(module, self.v.get(parent)))

    def __bool__(self) -> bool:
        return bool(self.k or self.v)


def without_kv_scales(weights: WeightsFn, scales: KVScales) -> WeightsFn:
    """`weights` less its KV scales, which each pass records into `scales`."""

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights():
            if not scales.take(name, tensor):
                yield name, tensor

    return stream


def apply_kv_scales(model: nn.Module, scales: KVScales) -> int:
    """Hands each attention layer (a module with set_kv_scales) its checkpoint scales;
    returns how many layers got one."""
    if not scales:
        return 0
    n = 0
    for name, module in model.named_modules():
        setter = getattr(module, "set_kv_scales", None)
        if setter is None:
            continue
        k, v = scales.of(name)
        if k is not None or v is not None:
            setter(k, v)
            n += 1
    if n:
        logger.info("KV cache scales from the checkpoint: %d attention layers", n)
    else:
        logger.warning("the checkpoint's %d KV cache scales match no attention layer: an FP8 "
                       "KV cache uses 1.0", len(scales.k) + len(scales.v))
    return n
