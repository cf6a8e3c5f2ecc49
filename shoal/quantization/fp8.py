"""FP8 weights, dequantized at load; and the FP8 rounding of a dense weight (online FP8).

On disk (quant_method "fp8"), a quantized linear `P` with N outputs and K inputs stores
- `P.weight`: float8_e4m3fn [N, K], the weight divided by its scale;
- its scale, which multiplies the stored values back (float32, or bfloat16), either
  - `P.weight_scale_inv` [ceil(N / bn), ceil(K / bk)]: one scale per bn x bk tile, with
    [bn, bk] the config's `weight_block_size` (usually [128, 128]; DeepSeek-V3/R1 and the
    Qwen3 "-FP8" releases). "inv" because it is the reciprocal of the quantizer's divisor:
    it multiplies, as the other form does. Edge tiles are partial.
  - or `P.weight_scale`: one per tensor (shape [] or [1]) or per output row ([N] or [N, 1]),
    as llm-compressor and vLLM's own FP8 serialization write;
- with activation_scheme "static", `P.input_scale` (the activations' fixed scale): unused
  here, where activations stay in the model's dtype.
Modules left dense (embeddings, norms, routers, often lm_head) keep their ordinary dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0  # largest finite float8_e4m3fn


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor,
                   block: tuple[int, int] | None = None) -> torch.Tensor:
    """float32 [N, K] from a float8 weight and its scale (block tiles when `block` is given
    and the scale is 2-D with more than one column or more rows than N; else per tensor or
    per row)."""
    if weight.dim() != 2:
        raise ValueError(f"fp8 weight must be 2-D (got shape {tuple(weight.shape)})")
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    n, k = w.shape
    if s.numel() == 1:
        return w * s.reshape(())
    if s.dim() == 2 and block is not None and not (s.shape == (n, 1)):
        return _dequantize_blocks(w, s, block)
    if s.numel() == n:
        return w * s.reshape(n, 1)
    raise ValueError(f"fp8 scale of shape {tuple(s.shape)} does not fit a weight of shape "
                     f"{(n, k)} (weight_block_size {block})")


def _dequantize_blocks(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    if tuple(s.shape) != (rows, cols):
        raise ValueError(f"fp8 weight_scale_inv has shape {tuple(s.shape)}; a weight of shape "
                         f"{(n, k)} in {bn}x{bk} blocks needs {(rows, cols)}")
    # Pad to whole tiles, scale each tile through a 4-D view, then cut the padding off.
    padded = F.pad(w, (0, cols * bk - k, 0, rows * bn - n))
    tiles = padded.view(rows, bn, cols, bk) * s.view(rows, 1, cols, 1)
    return tiles.view(rows * bn, cols * bk)[:n, :k]


def fp8_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """The weight as online FP8 would hold it: each output row scaled so that its largest
    |value| is e4m3's largest, rounded to float8_e4m3fn and multiplied back (float32).
    This reproduces FP8's rounding error, not its memory or speed."""
    w = weight.to(torch.float32)
    amax = w.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.to(torch.float32) * scale
