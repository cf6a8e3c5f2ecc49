"""One quantized linear in the layout the GPU fast path keeps (`PackedLinear`), from each
checkpoint format's tensors or from a dense weight, and back to a dense float32 weight (the
reference every kernel is tested against, and the fallback of a layer that cannot run packed).

Every part has the N output rows first, so the models' own weight loaders (which place the
rows of q/k/v or gate/up at their offsets in a fused layer, and this rank's slice of them)
place each part as they would place a dense weight (handles.py).

- "fp8": `weight` float8_e4m3fn [N, K]; `scale` float32 [N, ceil(K / group)] (one column:
  per-channel, per-tensor scales repeated down the rows; more: a block checkpoint's
  [bn, bk] tiles with each tile's scale repeated over its bn rows, group = bk);
  `input_scale` float32 [N, 1] (a static checkpoint's activation scale, repeated; NaN when
  activations are scaled per token at run time).
- "int4": `codes` int32 [N, ceil(K / 8)], code k at bits 4 (k % 8) of word k // 8 (unsigned
  0..15); `scale` float32 [N, ceil(K / group)]; `zero` uint8 [N, ceil(K / group)] (8 for a
  symmetric checkpoint). weight[n, k] = scale[n, g] * (code[n, k] - zero[n, g]), g = k //
  group. GPTQ act-order: `perm` (not a row part) says which input each stored column is:
  codes column i holds input perm[i], and groups run consecutively over the stored order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
FP8_PARTS = ("weight", "scale", "input_scale")
INT4_PARTS = ("codes", "scale", "zero")


@dataclass
class PackedLinear:
    kind: str  # "fp8" or "int4"
    in_features: int  # K
    group: int  # inputs per scale column (K: one column)
    parts: dict[str, torch.Tensor] = field(default_factory=dict)  # each [N, ...]
    perm: torch.Tensor | None = None  # int4 act-order: stored column -> input (int64 [K])

    @property
    def out_features(self) -> int:
        return next(iter(self.parts.values())).shape[0]

    def rows(self, start: int, size: int) -> PackedLinear:
        """Rows start .. start + size (a model that loads part of a checkpoint tensor)."""
        return PackedLinear(self.kind, self.in_features, self.group,
                            {k: v.narrow(0, start, size) for k, v in self.parts.items()},
                            self.perm)


# ---- from dense weights (online FP8, dummy weights, tests) ----------------------------------

def quantize_fp8(w: torch.Tensor, block: tuple[int, int] | None = None) -> PackedLinear:
    """Per output row (block None) or per [bn, bk] tile: scale = amax / 448, round to e4m3."""
    w = w.float()
    n, k = w.shape
    if block is None:
        scale = (w.abs().amax(1, keepdim=True) / E4M3_MAX).clamp_min(1e-12)
        q = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return _fp8(q, scale, k)
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    tiles = F.pad(w, (0, cols * bk - k, 0, rows * bn - n)).view(rows, bn, cols, bk)
    tile_scale = (tiles.abs().amax((1, 3)) / E4M3_MAX).clamp_min(1e-12)  # [rows, cols]
    q = (tiles / tile_scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    q = q.view(rows * bn, cols * bk)[:n, :k].to(torch.float8_e4m3fn)
    return _fp8(q, tile_scale.repeat_interleave(bn, 0)[:n], bk)


def quantize_int4(w: torch.Tensor, group: int, sym: bool = True) -> PackedLinear:
    """Round to nearest on a min-max grid per group of inputs (group -1: per channel);
    scales rounded to float16 first, as GPTQ and AWQ store them."""
    w = w.float()
    n, k = w.shape
    group = k if group == -1 else group
    groups = -(-k // group)
    g = F.pad(w, (0, groups * group - k)).view(n, groups, group)
    if sym:
        scale = g.abs().amax(-1) / 7.5
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        scale = (hi - lo) / 15
        zero = (-lo / scale.clamp_min(1e-12)).round().clamp(0, 15)
    scale = scale.clamp_min(1e-8).half().float()
    codes = (g / scale[..., None] + zero[..., None]).round().clamp(0, 15)
    codes = codes.view(n, groups * group)[:, :k].to(torch.int32)
    return PackedLinear("int4", k, group, {"codes": pack_k(codes), "scale": scale,
                                           "zero": zero.to(torch.uint8)})


def _fp8(q: torch.Tensor, scale: torch.Tensor, group: int,
         input_scale: torch.Tensor | None = None) -> PackedLinear:
    n, k = q.shape
    inp = torch.full((n, 1), float("nan")) if input_scale is None else \
        input_scale.float().reshape(()).expand(n, 1)
    return PackedLinear("fp8", k, group, {"weight": q, "scale": scale.float().contiguous(),
                                          "input_scale": inp.to(q.device).contiguous()})


# ---- from checkpoint tensors ----------------------------------------------------------------

def fp8_packed(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               input_scale: torch.Tensor | None = None) -> PackedLinear | None:
    """An fp8 checkpoint's linear (scale as fp8.dequantize_fp8 reads it); None for e5m2."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        return None
    n, k = weight.shape
    s = scale.float()
    if s.numel() == 1:
        return _fp8(weight, s.reshape(1, 1).expand(n, 1), k, input_scale)
    if s.dim() == 2 and block is not None and tuple(s.shape) != (n, 1):
        bn, bk = block
        if tuple(s.shape) != (-(-n // bn), -(-k // bk)):
            return None  # the dequantizer names the mismatch
        return _fp8(weight, s.repeat_interleave(bn, 0)[:n], bk, input_scale)
    if s.numel() == n:
        return _fp8(weight, s.reshape(n, 1), k, input_scale)
    return None


def gptq_packed(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
                g_idx: torch.Tensor | None, bits: int, group_size: int,
                v1_zeros: bool) -> PackedLinear | None:
    """4-bit GPTQ; None for 8-bit or an act-order whose groups are not group_size inputs
    each (those stay on the dequantize path)."""
    from shoal.quantization.packing import unpack_int32

    if bits != 4:
        return None
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    zeros = unpack_int32(qzeros, 4, dim=1)[:, :n] + (1 if v1_zeros else 0)
    if zeros.shape != scales.shape or zeros.min() < 0 or zeros.max() > 255:
        return None
    size = k if group_size == -1 else group_size
    codes = qweight.t().contiguous()  # [N, K / 8]: already packed along the inputs
    perm = None
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(k) // size):
        perm = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[perm], torch.arange(k) // size):
            return None
        codes = pack_k(unpack_int32(qweight, 4, dim=0).t()[:, perm])
    return PackedLinear("int4", k, size, {"codes": codes, "scale": scales.float().t(),
                                          "zero": zeros.t().to(torch.uint8)}, perm)


def awq_packed(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group_size: int) -> PackedLinear:
    from shoal.quantization.awq import unpack_awq

    codes = unpack_awq(qweight)  # [K, N]
    k = codes.shape[0]
    size = k if group_size == -1 else group_size
    return PackedLinear("int4", k, size, {"codes": pack_k(codes.t()),
                                          "scale": scales.float().t(),
                                          "zero": unpack_awq(qzeros).t().to(torch.uint8)})


def ct_packed(scheme, fmt: str, parts: dict[str, torch.Tensor]) -> PackedLinear | None:
    """compressed-tensors: 4-bit pack-quantized int (group or channel, either symmetry) and
    float-quantized FP8 (tensor, channel or block); None for everything else."""
    w = scheme.weights
    if w is None or getattr(w, "actorder", None) or getattr(w, "dynamic", False):
        return None
    strategy = getattr(w.strategy, "value", w.strategy)
    if fmt == "float-quantized" and w.type == "float" and w.num_bits == 8:
        block = tuple(w.block_structure) if strategy == "block" else None
        return fp8_packed(parts["weight"], parts["weight_scale"], block)
    if fmt != "pack-quantized" or w.type != "int" or w.num_bits != 4 \
            or strategy not in ("group", "channel"):
        return None
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    n, k = (int(v) for v in parts["weight_shape"].tolist())
    scale = parts["weight_scale"].float().reshape(n, -1)
    size = w.group_size if strategy == "group" else k
    if "weight_zero_point" in parts and not w.symmetric:
        zero = unpack_from_int32(parts["weight_zero_point"], 4, scale.shape, packed_dim=0)
        zero = zero.to(torch.int32) + 8
    else:
        zero = torch.full(scale.shape, 8, dtype=torch.int32)
    return PackedLinear("int4", k, size, {"codes": parts["weight_packed"].contiguous(),
                                          "scale": scale, "zero": zero.to(torch.uint8)})


# ---- packing and the dense reference ---------------------------------------------------------

def pack_k(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> int32 [N, ceil(K / 8)], 8 per word along K, lowest bits first."""
    n, k = codes.shape
    padded = F.pad(codes.to(torch.int64), (0, -k % 8)).view(n, -1, 8)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * 4
    words = (padded << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_k(words: torch.Tensor, k: int) -> torch.Tensor:
    """pack_k's inverse: int32 [N, ceil(K / 8)] -> int32 [N, K]."""
    shifts = torch.arange(8, device=words.device, dtype=torch.int32) * 4
    return ((words.unsqueeze(-1) >> shifts) & 15).flatten(1)[:, :k]


def dequantize_packed(p: PackedLinear) -> torch.Tensor:
    """float32 [N, K] in the original input order."""
    k = p.in_features
    cols = torch.arange(k, device=p.parts["scale"].device) // p.group
    if p.kind == "fp8":
        return p.parts["weight"].float() * p.parts["scale"][:, cols]
    codes = unpack_k(p.parts["codes"], k)
    w = (codes - p.parts["zero"].to(torch.int32)[:, cols]).float() * p.parts["scale"][:, cols]
    if p.perm is not None:
        dense = torch.empty_like(w)
        dense[:, p.perm.to(w.device)] = w
        return dense
    return w
