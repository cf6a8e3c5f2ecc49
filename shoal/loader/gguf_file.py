"""Open a GGUF file and read its metadata, turning every failure into an error that names the file."""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType

GGUF_MAGIC = b"GGUF"
# Items of one metadata array (vocabularies and merge lists: up to ~1M in real files).
MAX_ARRAY_ITEMS = 1 << 23
_ARRAY = int(GGUFValueType.ARRAY)  # a plain int: enum attribute lookups are slow here
_NATIVE_ORDERS = frozenset({"=", "I", "|"})  # byte orders whose view changes nothing
SUPPORTED_VERSIONS = (2, 3)
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # name length, dimension count, type, offset
_MIN_KV = 8 + 4 + 1  # key length, value type, the smallest value


class _PlainViewReader(GGUFReader):
    """GGUFReader over a plain ndarray view of its memmap, with bounds-checked reads.

    Same mapping, no copy; the reader slices its buffer once per metadata item (~250k times for a
    49k-token vocabulary) and np.memmap's per-slice bookkeeping makes parsing twice as slow.

    The reader trusts the file's lengths: a read past the end gives an empty array, so an
    array claiming 2**63 items of a scalar type loops forever on empty reads. Here every read
    must lie inside the file, and an array may hold at most MAX_ARRAY_ITEMS items (each item
    becomes a Python object: far more would exhaust memory).
    """

    @property
    def data(self) -> np.ndarray:
        return self._buffer

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._buffer = value.view(np.ndarray)

    def _get(self, offset: int, dtype: Any, count: int = 1,
             override_order: Any = None) -> np.ndarray:
        """GGUFReader._get with a bounds check (and a cached item size: it is called for
        every metadata item)."""
        count = int(count)
        buf = self._buffer
        end = offset + _itemsize(dtype) * count
        if offset < 0 or count < 0 or end > buf.shape[0]:
            raise ValueError(f"a field at byte {offset} runs past the end of the file "
                             f"({buf.shape[0]} bytes)")
        arr = buf[offset:end].view(dtype=dtype)
        order = self.byte_order if override_order is None else override_order
        if order in _NATIVE_ORDERS:  # the common case: the view is already right
            return arr
        return arr.view(arr.dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
        if raw_type == _ARRAY:
            count = int(self._get(orig_offs + 4, np.uint64)[0])
            if count > MAX_ARRAY_ITEMS:
                raise ValueError(f"an array at byte {orig_offs} claims {count} items (at most "
                                 f"{MAX_ARRAY_ITEMS} are read)")
        return super()._get_field_parts(orig_offs, raw_type)


@functools.cache
def _itemsize(dtype: Any) -> int:
    return np.dtype(dtype).itemsize


@dataclass
class GGUFFile:
    """A memory-mapped GGUF file: metadata is decoded on demand, tensor data stays on disk."""

    path: Path
    reader: GGUFReader

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            value = field.contents()
        except Exception as exc:  # a field whose bytes don't decode means the file is damaged
            raise ValueError(
                f"damaged GGUF file {self.path}: cannot decode {key!r}: {exc}"
            ) from exc
        return value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF file {self.path} lacks the required metadata key {key!r}")
        return value

    def tensor_names(self) -> list[str]:
        return [tensor.name for tensor in self.reader.tensors]


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse the header of a GGUF file (tensor data is only mapped, not read)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    size = path.stat().st_size
    with path.open("rb") as handle:
        head = handle.read(_HEADER.size)
    magic = head[:4]
    if magic != GGUF_MAGIC:
        raise ValueError(
            f"{path} is not a GGUF file: it starts with {magic!r} instead of the magic {GGUF_MAGIC!r}"
        )
    _check_header_counts(path, head, size)
    try:
        reader = _PlainViewReader(path, "r")
    except Exception as exc:  # the reader raises assorted numpy/struct errors on bad bytes
        raise ValueError(
            f"damaged or truncated GGUF file {path} ({size} bytes): {type(exc).__name__}: {exc}"
        ) from exc
    _check_tensor_extents(path, reader, size)
    return GGUFFile(path=path, reader=reader)


def _check_header_counts(path: Path, head: bytes, size: int) -> None:
    """The header's counts must fit the file before the reader loops over them: each tensor
    description takes at least 24 bytes, each metadata item at least 13."""
    if len(head) < _HEADER.size:
        raise ValueError(f"truncated GGUF file {path}: {size} bytes, no complete header")
    _, version, n_tensors, n_kv = _HEADER.unpack(head)
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(f"GGUF file {path} has version {version}; shoal reads versions "
                         f"{', '.join(map(str, SUPPORTED_VERSIONS))}")
    room = size - _HEADER.size
    if n_tensors * _MIN_TENSOR_INFO + n_kv * _MIN_KV > room:
        raise ValueError(f"damaged GGUF file {path}: its header announces {n_tensors} tensors "
                         f"and {n_kv} metadata items, more than {size} bytes can hold")


def _check_tensor_extents(path: Path, reader: GGUFReader, size: int) -> None:
    # The reader slices the memmap without bounds checks, so a short file can still parse when
    # the cut lands exactly on a tensor boundary; check every tensor's byte range explicitly.
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size or tensor.data.nbytes != int(tensor.n_bytes):
            raise ValueError(
                f"truncated GGUF file {path}: tensor {tensor.name!r} needs bytes up to {end} "
                f"but the file has {size}"
            )
