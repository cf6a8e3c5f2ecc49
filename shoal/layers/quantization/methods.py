"""What a quantized linear layer calls instead of a dense matmul (`layer.quant(x)`), built at
load from a shoal.quantization.packed.PackedLinear by `make_quant_linear`, which picks the path:

- FP8 with one weight scale per output row (per-tensor and per-channel checkpoints, online
  FP8): torch._scaled_mm on Hopper's FP8 tensor cores, activations scaled per token at run
  time (`fp8_quant.py`), or by the checkpoint's static scale;
- FP8 with block scales (weight_block_size): the Triton GEMM of fp8_block_gemm.py, activations
  scaled per token and group of the block's K width;
- INT4 weight-only (GPTQ, AWQ, compressed-tensors W4A16): the Triton W4A16 GEMM, or above
  `dense_above_m` rows (SHOAL_W4A16_DENSE_ABOVE_M) the weight dequantized and one bf16 matmul.
None: the layer keeps its dense dequantized weight (a shape or device no kernel here takes)."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from shoal import envs
from shoal.layers.quantization import decode_gemv
from shoal.layers.quantization import int4_mma_gemv as mma
from shoal.layers.quantization.fp8_block_gemm import fp8_block_matmul
from shoal.layers.quantization.fp8_quant import quantize_fp8_groups, quantize_fp8_static
from shoal.layers.quantization.launch_tuner import run_fastest
from shoal.layers.quantization.w4a16_gemm import block_k_for, w4a16_matmul

FP8_GROUP = 128  # activation group of per-channel weights that take the block kernel
DENSE_ABOVE_M_ENV = envs.SHOAL_W4A16_DENSE_ABOVE_M.name


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _decode_rows(flat: torch.Tensor) -> bool:
    """A few rows on the GPU (or the interpreter): the weight-only GEMVs are candidates."""
    return 0 < flat.shape[0] <= decode_gemv.MAX_ROWS and flat.dtype != torch.float64


def _row_bucket(flat: torch.Tensor) -> int:
    """Rows rounded up to a power of two: one tuning key (and candidate list) per bucket."""
    return 1 << (flat.shape[0] - 1).bit_length()


def _tune_key(kind: str, weight_shape: tuple[int, ...], group: int, flat: torch.Tensor
              ) -> tuple:
    return (kind, *weight_shape, group, _row_bucket(flat), flat.dtype)


def _gemv_name(t: decode_gemv.GemvTiles) -> str:
    name = f"gemv n{t.block_n} k{t.block_k} split{t.split}"
    if t.kernel == "strip":
        return name
    return (f"{name} {t.kernel} w{t.num_warps}" + (" prefetch" if t.prefetch else "")
            + (" tiled" if t.tiled else ""))


@dataclass(frozen=True)
class _Candidates:
    """A shape's launch candidates: the tensor-core kernel's name first (the heuristic's pick),
    then the GEMV tiles by name. Built once per shape: the eager decode path asks for them at
    every call of every layer."""
    names: tuple[str, ...]
    tiles: dict[str, decode_gemv.GemvTiles]


@functools.cache
def _fp8_candidates(first: str, n: int, k: int, group: int, device: torch.device,
                    rows: int = 1) -> _Candidates:
    tiles = {_gemv_name(t): t for t in decode_gemv.fp8_candidates(n, k, group, device, rows)}
    return _Candidates((first, *tiles), tiles)


@functools.cache
def _int4_candidates(first: str, n: int, k: int, group: int, device: torch.device,
                     rows: int = 1, dtype: torch.dtype | None = None,
                     tiled_block_n: int | None = None) -> _Candidates:
    tiles = {_gemv_name(t): t for t in decode_gemv.int4_candidates(n, k, group, device, rows,
                                                                   dtype, tiled_block_n)}
    return _Candidates((first, *tiles), tiles)


@dataclass
class FP8ScaledMM:
    weight: torch.Tensor  # float8_e4m3fn [N, K]
    weight_scale: torch.Tensor  # float32 [1, N]
    input_scale: torch.Tensor | None  # float32 0-d (static activations) or None (per token)

    name = "fp8 per-channel (torch._scaled_mm)"

    @property
    def nbytes(self) -> int:
        return _nbytes(self.weight, self.weight_scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.weight.shape
        flat = x.reshape(-1, k)
        if _decode_rows(flat) and self.input_scale is None:
            flat = flat.contiguous()
            cands = _fp8_candidates("scaled_mm", n, k, 0, flat.device, _row_bucket(flat))

            def run(name: str) -> torch.Tensor:
                if name == "scaled_mm":
                    return self._scaled_mm(flat)
                return decode_gemv.fp8_gemv(flat, self.weight, self.weight_scale.reshape(n),
                                            cands.tiles[name])

            y = run_fastest(_tune_key("fp8 channel", (n, k), 0, flat), cands.names, run,
                            flat.device)
        else:
            y = self._scaled_mm(flat)
        return y.view(*x.shape[:-1], n)

    def _scaled_mm(self, flat: torch.Tensor) -> torch.Tensor:
        n, k = self.weight.shape
        m = flat.shape[0]
        if self.input_scale is None:
            q, sa = quantize_fp8_groups(flat.contiguous(), k)
        else:
            q = quantize_fp8_static(flat, self.input_scale)
            sa = self.input_scale.reshape(1, 1).expand(m, 1).contiguous()
        # row-wise scaling writes bfloat16 only (on CUDA); other dtypes are cast after
        out = torch.bfloat16 if flat.is_cuda else flat.dtype
        y = torch._scaled_mm(q, self.weight.t(), scale_a=sa, scale_b=self.weight_scale,
                             out_dtype=out)
        return y.to(flat.dtype)


@dataclass
class FP8BlockLinear:
    weight: torch.Tensor  # float8_e4m3fn [N, K]
    weight_scale: torch.Tensor  # float32 [ceil(N / scale_rows), ceil(K / group)]
    group: int
    scale_rows: int

    @property
    def name(self) -> str:
        return f"fp8 block {self.scale_rows}x{self.group} (Triton)"

    @property
    def nbytes(self) -> int:
        return _nbytes(self.weight, self.weight_scale)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.weight.shape
        flat = x.reshape(-1, k).contiguous()
        if _decode_rows(flat):
            cands = _fp8_candidates("block gemm", n, k, self.group, flat.device,
                                    _row_bucket(flat))

            def run(name: str) -> torch.Tensor:
                if name == "block gemm":
                    return self._block_gemm(flat)
                return decode_gemv.fp8_gemv(flat, self.weight, self.weight_scale,
                                            cands.tiles[name], group=self.group,
                                            scale_rows=self.scale_rows)

            y = run_fastest(_tune_key(f"fp8 block {self.scale_rows}", (n, k), self.group, flat),
                            cands.names, run, flat.device)
        else:
            y = self._block_gemm(flat)
        return y.view(*x.shape[:-1], n)

    def _block_gemm(self, flat: torch.Tensor) -> torch.Tensor:
        q, sa = quantize_fp8_groups(flat, self.group)
        return fp8_block_matmul(q, sa, self.weight, self.weight_scale, self.group,
                                self.scale_rows, flat.dtype)


@dataclass
class Int4Linear:
    codes: torch.Tensor  # int32 [ceil(K / 8), N]
    scales: torch.Tensor  # [G, N], float16 where that is exact, else float32
    zeros: torch.Tensor | None  # uint8 [G, N]; None: symmetric (8)
    group: int
    in_features: int
    perm: torch.Tensor | None = None  # act-order: x columns in the codes' order
    dense_above_m: int | None = None  # rows above which dequantize + one dense matmul
    # SHOAL_INT4_TILED=1 (CUDA): the codes once more in tile_codes' layout (TILED_BLOCK_N
    # wide), which the decode tuner's extra tensor-core candidates read; an experiment
    tiled: torch.Tensor | None = None

    @property
    def name(self) -> str:
        group = "channel" if self.group >= self.in_features else f"g{self.group}"
        kind = "asym" if self.zeros is not None else "sym"
        order = ", act-order" if self.perm is not None else ""
        tiled = ", tiled copy" if self.tiled is not None else ""
        return f"int4 {group} {kind}{order}{tiled} (Triton W4A16)"

    @property
    def nbytes(self) -> int:
        return _nbytes(self.codes, self.scales, self.zeros, self.perm, self.tiled)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.perm is not None:
            flat = flat.index_select(1, self.perm)
        if self.dense_above_m is not None and flat.shape[0] > self.dense_above_m:
            y = flat @ self.dequantize(x.dtype)
        elif _decode_rows(flat):
            flat = flat.contiguous()
            n = self.codes.shape[1]
            cands = _int4_candidates("w4a16 gemm", n, self.in_features, self.group,
                                     flat.device, _row_bucket(flat), flat.dtype,
                                     None if self.tiled is None else mma.TILED_BLOCK_N)

            def run(name: str) -> torch.Tensor:
                if name == "w4a16 gemm":
                    return w4a16_matmul(flat, self.codes, self.scales, self.zeros, self.group)
                tiles = cands.tiles[name]
                return decode_gemv.int4_gemv(flat, self.tiled if tiles.tiled else self.codes,
                                             self.scales, self.zeros, self.group, tiles)

            kind = "int4 asym" if self.zeros is not None else "int4"
            y = run_fastest(_tune_key(kind, (self.in_features, n), self.group, flat),
                            cands.names, run, flat.device)
        else:
            y = w4a16_matmul(flat.contiguous(), self.codes, self.scales, self.zeros,
                             self.group)
        return y.view(*x.shape[:-1], self.codes.shape[1])

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """[K, N] in `dtype`, in the codes' input order."""
        shifts = torch.arange(8, device=self.codes.device, dtype=torch.int32).view(1, 8, 1) * 4
        codes = ((self.codes.unsqueeze(1) >> shifts) & 15).flatten(0, 1)[:self.in_features]
        g = torch.arange(self.in_features, device=codes.device) // self.group
        zero = 8 if self.zeros is None else self.zeros.to(torch.int32)[g]
        return ((codes - zero).to(torch.float32) * self.scales.float()[g]).to(dtype)


QuantLinear = FP8ScaledMM | FP8BlockLinear | Int4Linear


def fp8_supported(device: torch.device) -> bool:
    """FP8 tensor cores (Ada, Hopper and later); the CPU under Triton's interpreter (tests)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return os.environ.get("TRITON_INTERPRET") == "1"


def int4_supported(device: torch.device) -> bool:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return os.environ.get("TRITON_INTERPRET") == "1"


def make_quant_linear(packed, device: torch.device) -> QuantLinear | None:
    """The run-time form of a shoal.quantization.packed.PackedLinear on `device`, or None."""
    if packed.kind == "fp8":
        return _fp8(packed, device) if fp8_supported(device) else None
    if packed.kind == "int4":
        return _int4(packed, device) if int4_supported(device) else None
    return None


def _fp8(p, device: torch.device) -> QuantLinear | None:
    weight = p.parts["weight"].to(device).contiguous()
    scale = p.parts["scale"].to(device, torch.float32)
    n, k = weight.shape
    static = p.parts["input_scale"]
    # a fused layer whose parts have different static scales takes the largest (no clipping)
    input_scale = None if torch.isnan(static).any() else static.max().to(device).float()
    if scale.shape[1] == 1:  # one scale per output row
        if k % 16 == 0 and n % 16 == 0 and hasattr(torch, "_scaled_mm"):
            return FP8ScaledMM(weight, scale.reshape(1, n).contiguous(), input_scale)
        cols = -(-k // FP8_GROUP)
        return FP8BlockLinear(weight, scale.expand(n, cols).contiguous(), FP8_GROUP, 1)
    group = p.group
    if group < 16 or group > 256 or group & (group - 1):
        return None
    rows = 128
    if n % rows == 0 and torch.equal(scale, scale[::rows].repeat_interleave(rows, 0)):
        return FP8BlockLinear(weight, scale[::rows].contiguous(), group, rows)
    return FP8BlockLinear(weight, scale.contiguous(), group, 1)


def _int4(p, device: torch.device) -> Int4Linear | None:
    k = p.in_features
    group = min(p.group, k)
    try:
        block_k_for(group, k)
    except ValueError:
        return None
    scale = p.parts["scale"].float()
    half = scale.half()
    exact = torch.isfinite(half).all() and torch.equal(half.float(), scale)
    scales = (half if exact else scale).t().contiguous().to(device)
    zero = p.parts["zero"]
    zeros = None if bool((zero == 8).all()) else zero.t().contiguous().to(device)
    above = envs.SHOAL_W4A16_DENSE_ABOVE_M.get()
    codes = p.parts["codes"].t().contiguous().to(device)
    tiled = None
    if envs.SHOAL_INT4_TILED.get() and device.type == "cuda" \
            and codes.shape[1] % mma.TILED_BLOCK_N == 0 \
            and mma.step_fits(k, group, mma.TILED_WORDS):
        tiled = mma.tile_codes(codes, mma.TILED_BLOCK_N, mma.TILED_WORDS)
    return Int4Linear(codes, scales, zeros, group, k,
                      None if p.perm is None else p.perm.to(device), above, tiled)
