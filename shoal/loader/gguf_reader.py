"""Parse a GGUF file's header, metadata and tensor descriptions straight from a memory map.

gguf's GGUFReader builds numpy arrays for every item of every metadata array (~250k for a
49k-token vocabulary with its merges): over a second per open. Here numeric arrays are one numpy
view, string arrays are only walked (their lengths checked) and decoded on first use, and tensor
data is a view of the mapping that nothing reads until dequantization.

Every read is bounds-checked against the file and every count capped, so a damaged or hostile
file fails with a ValueError naming it instead of looping, over-allocating or reading garbage.
Little-endian files only (all llama.cpp writes); a big-endian one is refused by name.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType
from gguf.constants import GGML_QUANT_SIZES

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Items of one metadata array (vocabularies and merge lists: up to ~1M in real files).
MAX_ARRAY_ITEMS = 1 << 23
# Arrays nested in arrays, per file: llama.cpp writes none, and each one is a Python object.
MAX_NESTED_ARRAYS = 1 << 16
MAX_NESTING = 8

HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata count
_MIN_TENSOR_INFO = 8 + 4 + 4 + 8  # name length, dimension count, type, offset
_MIN_KV = 8 + 4 + 1  # key length, value type, the smallest value
_PSEUDO_FIELDS = (("GGUF.version", 4, GGUFValueType.UINT32),  # the header, as gguf lists it
                  ("GGUF.tensor_count", 8, GGUFValueType.UINT64),
                  ("GGUF.kv_count", 16, GGUFValueType.UINT64))
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# Plain ints as keys: value types arrive as ints, and enum lookups would cost on every item.
_STRING = int(GGUFValueType.STRING)
_ARRAY = int(GGUFValueType.ARRAY)
_NUMBERS: dict[int, tuple[struct.Struct, np.dtype]] = {
    int(vtype): (struct.Struct("<" + fmt), np.dtype("<" + fmt))
    for vtype, fmt in [
        (GGUFValueType.UINT8, "B"), (GGUFValueType.INT8, "b"),
        (GGUFValueType.UINT16, "H"), (GGUFValueType.INT16, "h"),
        (GGUFValueType.UINT32, "I"), (GGUFValueType.INT32, "i"),
        (GGUFValueType.UINT64, "Q"), (GGUFValueType.INT64, "q"),
        (GGUFValueType.FLOAT32, "f"), (GGUFValueType.FLOAT64, "d"),
        (GGUFValueType.BOOL, "?"),
    ]
}
# Tensor types viewed as typed arrays in their logical shape; all others (BF16 included, which
# numpy lacks) are raw bytes shaped [..., bytes per row], as gguf's dequantize expects.
_TYPED_TENSORS = {
    GGMLQuantizationType.F32: np.dtype("<f4"), GGMLQuantizationType.F16: np.dtype("<f2"),
    GGMLQuantizationType.F64: np.dtype("<f8"), GGMLQuantizationType.I8: np.dtype("i1"),
    GGMLQuantizationType.I16: np.dtype("<i2"), GGMLQuantizationType.I32: np.dtype("<i4"),
    GGMLQuantizationType.I64: np.dtype("<i8"),
}

Buffer = bytes | mmap.mmap  # the whole file: an mmap, or bytes for files too short to map


# ---- metadata values: parsed positions, decoded on demand ----------------------------------


@dataclass(frozen=True, slots=True)
class _Scalar:
    value: int | float | bool

    def decode(self, buf: Buffer) -> Any:
        return self.value


@dataclass(frozen=True, slots=True)
class _String:
    start: int
    end: int

    def decode(self, buf: Buffer) -> str:
        return str(buf[self.start:self.end], "utf-8")


@dataclass(frozen=True, slots=True, eq=False)
class _Numbers:
    item_type: int
    items: np.ndarray  # a read-only view of the mapping

    @property
    def count(self) -> int:
        return self.items.shape[0]

    def decode(self, buf: Buffer) -> list[Any]:
        return self.items.tolist()


@dataclass(frozen=True, slots=True)
class _Strings:
    item_type: int
    count: int
    start: int  # the first item's length prefix
    end: int

    def decode(self, buf: Buffer) -> list[str]:
        # One copy of the whole array, then slices of bytes: slicing the mmap item by item
        # costs twice as much. The walk at parse time checked every length against `end`.
        blob = buf[self.start:self.end]
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        at = 0
        for _ in range(self.count):
            (length,) = unpack(blob, at)
            at += 8
            append(blob[at:at + length].decode("utf-8"))
            at += length
        return out


@dataclass(frozen=True, slots=True)
class _Arrays:
    item_type: int
    items: tuple[_Value, ...]

    @property
    def count(self) -> int:
        return len(self.items)

    def decode(self, buf: Buffer) -> list[Any]:
        return [item.decode(buf) for item in self.items]


_Value = _Scalar | _String | _Numbers | _Strings | _Arrays


@dataclass(frozen=True, eq=False)
class GGUFField:
    """One metadata key and its value, decoded by contents() (strings are not decoded before)."""

    name: str
    offset: int  # of the key in the file
    type: GGUFValueType
    item_type: GGUFValueType | None  # of an array's items
    count: int  # an array's items; 1 for a scalar
    _value: _Value
    _buf: Buffer

    def contents(self) -> Any:
        """A Python scalar, str or list (lists of lists for nested arrays), freshly built.

        UnicodeDecodeError for a string that is not UTF-8."""
        return self._value.decode(self._buf)


@dataclass(frozen=True, eq=False)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # uint64 dimensions, fastest first (ne0 first), as stored
    n_elements: int
    n_bytes: int
    data_offset: int  # absolute, in the file
    data: np.ndarray  # read-only view: typed in reversed dims, or bytes for quantized types


@dataclass(frozen=True)
class GGUFContents:
    version: int
    alignment: int
    data_offset: int  # where the tensor data section starts
    fields: dict[str, GGUFField]  # also GGUF.version, GGUF.tensor_count and GGUF.kv_count
    tensors: list[GGUFTensor]


# ---- parsing --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorInfo:
    name: str
    dims: np.ndarray
    raw_type: int
    offset: int  # relative to the data section


def parse_gguf(buf: Buffer, name: str) -> GGUFContents:
    """Parse a whole GGUF file held in `buf` (an mmap, or bytes); `name` goes into errors."""
    return _Parser(buf, name).parse()


class _Parser:
    def __init__(self, buf: Buffer, name: str) -> None:
        self.buf = buf
        self.bytes = np.frombuffer(buf, dtype=np.uint8)
        self.size = self.bytes.shape[0]
        self.name = name
        self.pos = 0
        self.nested = 0

    def damaged(self, detail: str) -> ValueError:
        return ValueError(f"damaged GGUF file {self.name} ({self.size} bytes): {detail}")

    def parse(self) -> GGUFContents:
        version, n_tensors, n_kv = self.header()
        fields = {key: GGUFField(key, at, vtype, None, 1, _Scalar(value), self.buf)
                  for (key, at, vtype), value in zip(_PSEUDO_FIELDS, (version, n_tensors, n_kv))}
        for _ in range(n_kv):
            field = self.key_value()
            if field.name in fields:
                raise self.damaged(f"metadata key {field.name!r} appears twice")
            fields[field.name] = field
        infos = [self.tensor_info() for _ in range(n_tensors)]
        alignment = self.alignment(fields.get("general.alignment"))
        data_offset = -(-self.pos // alignment) * alignment
        tensors = self.tensors(infos, data_offset)
        return GGUFContents(version=version, alignment=alignment, data_offset=data_offset,
                            fields=fields, tensors=tensors)

    def header(self) -> tuple[int, int, int]:
        magic = bytes(self.buf[:4])
        if len(magic) == 4 and magic != GGUF_MAGIC:
            raise ValueError(f"{self.name} is not a GGUF file: it starts with {magic!r} instead "
                             f"of the magic {GGUF_MAGIC!r}")
        if self.size < HEADER.size:
            raise ValueError(f"truncated GGUF file {self.name}: {self.size} bytes, "
                             f"no complete header")
        _, version, n_tensors, n_kv = HEADER.unpack_from(self.buf, 0)
        if int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF file {self.name} is big-endian; shoal reads little-endian "
                             f"GGUF files only")
        if version not in SUPPORTED_VERSIONS:
            raise ValueError(f"GGUF file {self.name} has version {version}; shoal reads "
                             f"versions {', '.join(map(str, SUPPORTED_VERSIONS))}")
        # The counts must fit the file before anything loops over them.
        if n_tensors * _MIN_TENSOR_INFO + n_kv * _MIN_KV > self.size - HEADER.size:
            raise ValueError(f"damaged GGUF file {self.name}: its header announces {n_tensors} "
                             f"tensors and {n_kv} metadata items, more than {self.size} bytes "
                             f"can hold")
        self.pos = HEADER.size
        return version, n_tensors, n_kv

    # -- primitive reads, each inside the file

    def take(self, n: int, what: str) -> int:
        """Start of the next n bytes, which must lie inside the file."""
        start = self.pos
        if start + n > self.size:
            raise ValueError(f"truncated GGUF file {self.name} ({self.size} bytes): {what} at "
                             f"byte {start} needs {n} bytes, past the end of the file")
        self.pos = start + n
        return start

    def u32(self, what: str) -> int:
        return _U32.unpack_from(self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return _U64.unpack_from(self.buf, self.take(8, what))[0]

    def string(self, what: str) -> _String:
        length = self.u64(f"the length of {what}")
        start = self.take(length, what)
        return _String(start, start + length)

    def text(self, what: str) -> str:
        span = self.string(what)
        try:
            return span.decode(self.buf)
        except UnicodeDecodeError as exc:
            raise self.damaged(f"{what} at byte {span.start - 8} is not UTF-8: {exc}") from None

    # -- metadata

    def key_value(self) -> GGUFField:
        at = self.pos
        key = self.text("a metadata key")
        vtype = self.u32(f"the type of {key!r}")
        if vtype == _ARRAY:
            array = self.array(key, 1)
            return GGUFField(key, at, GGUFValueType.ARRAY, GGUFValueType(array.item_type),
                             array.count, array, self.buf)
        value = self.value(vtype, key)  # first: it rejects unknown types by name
        return GGUFField(key, at, GGUFValueType(vtype), None, 1, value, self.buf)

    def value(self, vtype: int, key: str) -> _Value:
        number = _NUMBERS.get(vtype)
        if number is not None:
            fmt = number[0]
            return _Scalar(fmt.unpack_from(self.buf, self.take(fmt.size, repr(key)))[0])
        if vtype == _STRING:
            return self.string(repr(key))
        raise self.damaged(f"{key!r} at byte {self.pos - 4} has unknown value type {vtype}")

    def array(self, key: str, depth: int) -> _Numbers | _Strings | _Arrays:
        at = self.pos
        item_type = self.u32(f"the item type of {key!r}")
        count = self.u64(f"the length of {key!r}")
        if count > MAX_ARRAY_ITEMS:
            raise self.damaged(f"array {key!r} at byte {at} claims {count} items (at most "
                               f"{MAX_ARRAY_ITEMS} are read)")
        number = _NUMBERS.get(item_type)
        if number is not None:
            dtype = number[1]
            start = self.take(count * dtype.itemsize, f"array {key!r}")
            return _Numbers(item_type, self.bytes[start:self.pos].view(dtype))
        if item_type == _STRING:
            return self.strings(key, item_type, count)
        if item_type == _ARRAY:
            if depth >= MAX_NESTING:
                raise self.damaged(f"array {key!r} at byte {at} nests arrays more than "
                                   f"{MAX_NESTING} deep")
            self.nested += count
            if self.nested > MAX_NESTED_ARRAYS:
                raise self.damaged(f"array {key!r} at byte {at}: more than {MAX_NESTED_ARRAYS} "
                                   f"nested arrays in the file")
            return _Arrays(item_type, tuple(self.array(key, depth + 1) for _ in range(count)))
        raise self.damaged(f"array {key!r} at byte {at} has unknown item type {item_type}")

    def strings(self, key: str, item_type: int, count: int) -> _Strings:
        """Walk a string array's length prefixes (decoding waits for contents())."""
        start = self.pos
        if count * 8 > self.size - start:  # every item has its 8-byte length at least
            raise self.damaged(f"array {key!r} at byte {start} claims {count} strings, more "
                               f"than the rest of the file holds")
        unpack, buf, at = _U64.unpack_from, self.buf, start
        try:
            for _ in range(count):
                at += 8 + unpack(buf, at)[0]
        except (struct.error, OverflowError):  # a length prefix past the end of the file
            at = self.size + 1
        if at > self.size:
            raise ValueError(f"truncated GGUF file {self.name} ({self.size} bytes): a string "
                             f"of array {key!r} (from byte {start}) runs past the end of the "
                             f"file")
        self.pos = at
        return _Strings(item_type, count, start, at)

    def alignment(self, field: GGUFField | None) -> int:
        if field is None:
            return DEFAULT_ALIGNMENT
        if field.type != GGUFValueType.UINT32:
            raise self.damaged(f"general.alignment has type {field.type.name}, not UINT32")
        alignment = field.contents()
        if alignment <= 0 or alignment & (alignment - 1):
            raise self.damaged(f"general.alignment is {alignment}, not a power of two")
        return alignment

    # -- tensors

    def tensor_info(self) -> _TensorInfo:
        name = self.text("a tensor name")
        n_dims = self.u32(f"the dimension count of tensor {name!r}")
        start = self.take(8 * n_dims, f"the dimensions of tensor {name!r}")
        dims = self.bytes[start:start + 8 * n_dims].view("<u8")
        raw_type = self.u32(f"the type of tensor {name!r}")
        offset = self.u64(f"the data offset of tensor {name!r}")
        return _TensorInfo(name, dims, raw_type, offset)

    def tensors(self, infos: list[_TensorInfo], data_offset: int) -> list[GGUFTensor]:
        tensors, names = [], set()
        for info in infos:
            if info.name in names:
                raise self.damaged(f"tensor {info.name!r} appears twice")
            names.add(info.name)
            tensors.append(self.tensor(info, data_offset))
        return tensors

    def tensor(self, info: _TensorInfo, data_offset: int) -> GGUFTensor:
        name = info.name
        try:
            tensor_type = GGMLQuantizationType(info.raw_type)
        except ValueError:
            raise self.damaged(f"tensor {name!r} has unknown type {info.raw_type}") from None
        block, type_size = GGML_QUANT_SIZES[tensor_type]
        dims = [int(d) for d in info.dims.tolist()]
        n_elements = math.prod(dims)  # Python ints: huge hostile dims cannot overflow
        n_bytes = n_elements * type_size // block
        start = data_offset + info.offset
        end = start + n_bytes
        if end > self.size:
            raise ValueError(f"truncated GGUF file {self.name}: tensor {name!r} needs bytes up "
                             f"to {end} but the file has {self.size}")
        shape = tuple(reversed(dims))
        dtype = _TYPED_TENSORS.get(tensor_type)
        if dtype is None:  # rows of blocks, as bytes
            if not dims or dims[0] % block:
                raise self.damaged(f"tensor {name!r} of shape {dims} does not divide into "
                                   f"{tensor_type.name} blocks of {block} values")
            dtype, shape = np.dtype(np.uint8), (*shape[:-1], dims[0] // block * type_size)
        try:
            data = self.bytes[start:end].view(dtype).reshape(shape)
        except (ValueError, OverflowError) as exc:  # dimensions numpy cannot index
            raise self.damaged(f"tensor {name!r} has shape {dims}: {exc}") from None
        return GGUFTensor(name=name, tensor_type=tensor_type, shape=info.dims,
                          n_elements=n_elements, n_bytes=n_bytes, data_offset=start, data=data)
