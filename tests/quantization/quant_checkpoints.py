"""Test helpers: the quantizer side of each format, written plainly (the packers loop over
bit positions; shoal's readers shift tensors), and folders that hold a quantized checkpoint
next to the dense one built from the same dequantized weights.

Each quantizer returns the tensors to store for one linear (local names) and the weight they
stand for, computed here from the integer codes and the stored scales: the reference."""

from __future__ import annotations

import json
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# The linear layers of Llama, Qwen3(-MoE) and DeepSeek-V2/V3 (routers and heads excluded).
LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|q_a_proj|"
                    r"q_b_proj|kv_a_proj_with_mqa|kv_b_proj)\.weight$")
E4M3_MAX = 448.0


@dataclass
class Quantized:
    stored: dict[str, torch.Tensor]  # local name -> tensor, e.g. {"qweight": ..., ...}
    reference: torch.Tensor  # float32 [N, K]: what `stored` dequantizes to


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words holding 32 unsigned bits -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] codes -> [R * bits / 32, C]: value r at bits (r % per) * bits of word r // per."""
    per = 32 // bits
    words = torch.zeros(codes.shape[0] // per, codes.shape[1], dtype=torch.int64)
    for j in range(per):
        words |= codes[j::per].long() << (bits * j)
    return _to_int32(words)


def pack_cols(codes: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """[R, C] -> [R, C * bits / 32]; slot j of a word holds column order[j] of its run."""
    per = 32 // bits
    order = order or list(range(per))
    words = torch.zeros(codes.shape[0], codes.shape[1] // per, dtype=torch.int64)
    for j in range(per):
        words |= codes[:, order[j]::per].long() << (bits * j)
    return _to_int32(words)


def _minmax_grid(w: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of w [R, C]: unsigned-code scale and zero (floats; zero an integer)."""
    maxq = 2**bits - 1
    if sym:
        scale = w.abs().amax(1).clamp_min(1e-6) * 2 / maxq
        zero = torch.full_like(scale, (maxq + 1) / 2)
    else:
        lo, hi = w.amin(1).clamp(max=0), w.amax(1).clamp(min=0)
        scale = ((hi - lo) / maxq).clamp_min(1e-6)
        zero = (-lo / scale).round().clamp(1, maxq)  # >= 1: GPTQ v1 cannot store zero 0
    return scale, zero


# ---- FP8 ----------------------------------------------------------------------------------

def fp8_block(w: torch.Tensor, block: tuple[int, int]) -> Quantized:
    n, k = w.shape
    bn, bk = block
    rows, cols = -(-n // bn), -(-k // bk)
    scale = torch.empty(rows, cols)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    ref = torch.empty(n, k)
    for i in range(rows):
        for j in range(cols):
            tile = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]
            s = float(tile.abs().max().clamp_min(1e-6)) / E4M3_MAX
            scale[i, j] = s
            qt = (tile / s).to(torch.float8_e4m3fn)
            q[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qt
            ref[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = qt.float() * scale[i, j]
    return Quantized({"weight": q, "weight_scale_inv": scale}, ref)


def fp8_rows(w: torch.Tensor, per_tensor: bool = False) -> Quantized:
    """Per-output-row scales [N, 1] (or one scale []), llm-compressor's layout."""
    amax = w.abs().amax() if per_tensor else w.abs().amax(1, keepdim=True)
    scale = amax.clamp_min(1e-6) / E4M3_MAX
    q = (w / scale).to(torch.float8_e4m3fn)
    return Quantized({"weight": q, "weight_scale": scale}, q.float() * scale)


def online_fp8_reference(w: torch.Tensor) -> torch.Tensor:
    scale = w.abs().amax(1, keepdim=True) / E4M3_MAX
    return (w / scale).to(torch.float8_e4m3fn).float() * scale


# ---- GPTQ / AWQ -----------------------------------------------------------------------------

def gptq(w: torch.Tensor, bits: int = 4, group: int = 32, act_order: bool = False,
         sym: bool = True, v1: bool = True, seed: int = 0) -> Quantized:
    """w [N, K] -> qweight [K/p, N], qzeros [G, N/p], scales [G, N] fp16, g_idx [K]."""
    n, k = w.shape
    size = k if group == -1 else group
    groups = k // size
    g_idx = torch.arange(k) // size
    if act_order:  # groups over a random order of the inputs, as activation order would be
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed))
        g_idx = torch.empty(k, dtype=torch.long)
        g_idx[perm] = torch.arange(k) // size
    scales, zeros = torch.empty(groups, n), torch.empty(groups, n)
    for g in range(groups):
        s, z = _minmax_grid(w[:, g_idx == g], bits, sym)
        scales[g], zeros[g] = s.half().float(), z
    wt = w.t()  # [K, N]
    codes = (wt / scales[g_idx] + zeros[g_idx]).round().clamp(0, 2**bits - 1)
    ref = ((codes - zeros[g_idx]) * scales[g_idx]).t().contiguous()
    stored_zeros = zeros - 1 if v1 else zeros
    return Quantized({"qweight": pack_rows(codes, bits),
                      "qzeros": pack_cols(stored_zeros, bits),
                      "scales": scales.half(), "g_idx": g_idx.to(torch.int32)}, ref)


def awq(w: torch.Tensor, group: int = 32) -> Quantized:
    """w [N, K] -> qweight [K, N/8], qzeros [G, N/8] (interleaved), scales [G, N] fp16."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    n, k = w.shape
    groups = k // group
    g = torch.arange(k) // group
    scales, zeros = torch.empty(groups, n), torch.empty(groups, n)
    for i in range(groups):
        s, z = _minmax_grid(w[:, g == i], 4, sym=False)
        scales[i], zeros[i] = s.half().float(), z
    codes = (w.t() / scales[g] + zeros[g]).round().clamp(0, 15)
    ref = ((codes - zeros[g]) * scales[g]).t().contiguous()
    return Quantized({"qweight": pack_cols(codes, 4, order),
                      "qzeros": pack_cols(zeros, 4, order), "scales": scales.half()}, ref)


# ---- compressed-tensors (its own compressors write the stored form) -------------------------

def ct_scheme(weights: dict, input_activations: dict | None = None) -> dict:
    return {"targets": ["Linear"], "weights": weights, "input_activations": input_activations}


def ct_quantize(w: torch.Tensor, scheme: dict, fmt: str) -> Quantized:
    """Scales and zero points chosen here (min-max), the weight rounded onto their grid (the
    reference), then stored by compressed-tensors' compressor for `fmt`."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    args = scheme["weights"]
    n, k = w.shape
    size = args.get("group_size") or k
    grouped = w.view(n, k // size, size) if args["strategy"] == "group" else w.view(n, 1, k)
    if args["type"] == "float":
        scale = grouped.abs().amax(-1).clamp_min(1e-6) / E4M3_MAX
        q = (grouped / scale[..., None]).to(torch.float8_e4m3fn).float()
        zero = torch.zeros_like(scale)
    else:
        bits = args["num_bits"]
        qmin, qmax = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
        if args["symmetric"]:
            scale = grouped.abs().amax(-1).clamp_min(1e-6) / qmax
            zero = torch.zeros_like(scale)
        else:
            lo, hi = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
            scale = ((hi - lo) / (qmax - qmin)).clamp_min(1e-6)
            zero = (qmin - lo / scale).round().clamp(qmin, qmax)
        q = (grouped / scale[..., None] + zero[..., None]).round().clamp(qmin, qmax)
    ref = ((q - zero[..., None]) * scale[..., None]).reshape(n, k)
    state = {"weight": ref, "weight_scale": scale}
    if not args["symmetric"]:
        state["weight_zero_point"] = zero.to(torch.int8)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    stored = compressor.compress(state, QuantizationScheme.model_validate(scheme))
    return Quantized(dict(stored), ref)


# ---- checkpoint folders ---------------------------------------------------------------------

def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def write_folder(dst: Path, src: Path, tensors: dict[str, torch.Tensor],
                 quantization_config: dict | None) -> Path:
    """A checkpoint folder with src's config (and quantization_config) and `tensors` split
    over two files by a hash of each name, so one linear's parts span files in either
    order."""
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    for extra in ("generation_config.json",):
        if (src / extra).is_file():
            shutil.copy(src / extra, dst / extra)
    shards: list[dict[str, torch.Tensor]] = [{}, {}]
    for name, t in tensors.items():
        shards[zlib.crc32(name.encode()) % 2][name] = t.contiguous()
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    for shard, file in zip(shards, files):
        save_file(shard, str(dst / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    return dst


def quantize_folder(src: Path, out: Path, quantize, quantization_config: dict | None,
                    select=None) -> tuple[Path, Path]:
    """(quantized folder, dense folder of the same dequantized weights) from the dense
    checkpoint src; `quantize(weight) -> Quantized` is applied to each linear weight that
    `select(module_name)` (default: all) accepts."""
    tensors = read_tensors(src)
    stored, dense = {}, {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if LINEAR.search(name) and (select is None or select(module)):
            q = quantize(t.float())
            stored.update({f"{module}.{k}": v for k, v in q.stored.items()})
            dense[name] = q.reference
        else:
            stored[name] = dense[name] = t
    quant = write_folder(out / "quantized", src, stored, quantization_config)
    return quant, write_folder(out / "dense", src, dense, None)
