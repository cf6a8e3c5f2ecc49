"""The weight stream of a quantized checkpoint, dequantized: what models' `load_weights`
read (HF names, dense tensors) from what the checkpoint stores (packed codes, scales, ...).

A quantized linear's tensors may come in any order and from different files: they wait in a
buffer, one entry per linear, until the last arrives; then `<module>.weight` is yielded in
`dtype` and the entry freed. Everything else passes through, cast to `dtype`. What the
buffer holds is still the compact stored form: at most the parts of the linears begun and
not finished, never the dense model.

On CUDA the fast path (fast_path.py) passes a packer: the linears it can run packed are
yielded as stand-ins that the models' weight loaders route like dense weights."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from shoal.quantization.config import QuantizationConfig
from shoal.quantization.formats import DROP, LinearFormat, Part, linear_format

logger = logging.getLogger(__name__)

Weights = Callable[[], Iterator[tuple[str, torch.Tensor]]]


@dataclass
class StreamStats:
    """One pass's tally, for the start-up log."""

    linears: int = 0  # quantized linears read
    packed: int = 0  # of which left packed for the GPU fast path
    dropped: int = 0  # activation / KV-cache scales left out
    disk_bytes: int = 0  # every tensor as stored
    out_bytes: int = 0  # every tensor yielded, in the stream's dtype
    seconds: float = 0.0


# A quantized linear's stored parts -> the tensor to yield as its weight instead of the
# dequantized one (the GPU fast path's stand-in: fast_path.py), or None to dequantize.
Packer = Callable[[LinearFormat, str, dict[str, torch.Tensor]], torch.Tensor | None]


@dataclass
class QuantizedStream:
    """`stored` (the checkpoint's tensors as stored) turned into dense weights; each call
    starts a fresh pass, as the wrapped function's does. with_packer: the same stream with
    linears the packer takes left packed."""

    stored: Weights
    qconfig: QuantizationConfig
    dtype: torch.dtype = torch.float32
    packer: Packer | None = None

    def __call__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return _weights(self.stored, self.qconfig, self.dtype, self.packer)

    def with_packer(self, packer: Packer) -> QuantizedStream:
        return QuantizedStream(self.stored, self.qconfig, self.dtype, packer)


def dequantized_weights(weights_fn: Weights, qconfig: QuantizationConfig,
                        dtype: torch.dtype = torch.float32) -> QuantizedStream:
    return QuantizedStream(weights_fn, qconfig, dtype)


def _weights(weights_fn: Weights, qconfig: QuantizationConfig, dtype: torch.dtype,
             packer: Packer | None) -> Iterator[tuple[str, torch.Tensor]]:
    fmt = linear_format(qconfig, keep_input_scales=packer is not None)
    stats = StreamStats()
    t0 = time.perf_counter()
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights_fn():
        stats.disk_bytes += tensor.nbytes
        kind = fmt.classify(name, tensor)
        if kind is None:
            out = tensor.to(dtype)
            stats.out_bytes += out.nbytes
            yield name, out
            continue
        if kind == DROP:
            stats.dropped += 1
            continue
        assert isinstance(kind, Part)
        parts = pending.setdefault(kind.module, {})
        if kind.key in parts:
            raise ValueError(f"checkpoint tensor {name!r} appears twice")
        parts[kind.key] = tensor
        if fmt.missing(kind.module, parts):
            continue
        del pending[kind.module]
        try:
            weight = None if packer is None else packer(fmt, kind.module, parts)
            if weight is None:
                weight = fmt.dequantize(kind.module, parts).to(dtype)
                stats.out_bytes += weight.nbytes
            else:
                stats.packed += 1
        except ValueError as e:
            raise ValueError(f"{kind.module}: {e}") from None
        stats.linears += 1
        yield f"{kind.module}.weight", weight
    if pending:
        raise ValueError(incomplete_message(pending, fmt, qconfig))
    stats.seconds = time.perf_counter() - t0
    log_stats(qconfig, stats, dtype)


def incomplete_message(pending: dict[str, dict[str, torch.Tensor]], fmt: LinearFormat,
                       qconfig: QuantizationConfig) -> str:
    lines = [f"{module}: has {', '.join(f'{module}.{k}' for k in sorted(parts))} but no "
             f"{' and no '.join(fmt.missing(module, parts))}"
             for module, parts in sorted(pending.items())[:5]]
    more = f" (and {len(pending) - 5} more)" if len(pending) > 5 else ""
    return (f"incomplete quantized weights ({qconfig.describe()}) in {len(pending)} "
            f"module(s){more}:\n  " + "\n  ".join(lines))


def log_stats(qconfig: QuantizationConfig, stats: StreamStats, dtype: torch.dtype) -> None:
    dropped = f"; {stats.dropped} activation/KV-cache scales unused" if stats.dropped else ""
    packed = f" ({stats.packed} left packed for the GPU)" if stats.packed else ""
    logger.info("quantized weights, %s: %d linear layers%s read at load in %.2f s; "
                "weights %s on disk, %s dequantized to %s%s", qconfig.describe(),
                stats.linears, packed, stats.seconds, human_bytes(stats.disk_bytes),
                human_bytes(stats.out_bytes), str(dtype).removeprefix("torch."), dropped)


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"
