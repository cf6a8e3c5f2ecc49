"""shoal's GGUF reader: the same contents as gguf's GGUFReader (the oracle) on real and synthetic
files, and a clear ValueError naming the file for every damaged or hostile one."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from gguf import GGUFWriter
from gguf.quants import quantize

from shoal.loader.gguf_file import GGUFFile, open_gguf
from shoal.loader.gguf_reader import MAX_ARRAY_ITEMS, MAX_NESTING
from shoal.loader.resolve import SMOLLM2, locate_embedded


def assert_same_as_gguf_reader(path: Path, skip: tuple[str, ...] = ()) -> GGUFFile:
    ours, oracle = open_gguf(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(oracle.fields)
    for key, expected in oracle.fields.items():
        if key in skip:
            continue
        value, wanted = ours.fields[key].contents(), expected.contents()
        assert value == wanted and _types(value) == _types(wanted), key  # int, float or bool
        assert ours.fields[key].offset == expected.offset, key
    assert ours.reader.data_offset == oracle.data_offset
    assert ours.reader.alignment == oracle.alignment
    assert len(ours.tensors) == len(oracle.tensors)
    for mine, theirs in zip(ours.tensors, oracle.tensors):
        assert (mine.name, mine.tensor_type, mine.n_elements, mine.n_bytes, mine.data_offset) == \
            (theirs.name, theirs.tensor_type, theirs.n_elements, theirs.n_bytes, theirs.data_offset)
        assert mine.shape.dtype == theirs.shape.dtype
        np.testing.assert_array_equal(mine.shape, theirs.shape)
        assert mine.data.dtype == theirs.data.dtype and mine.data.shape == theirs.data.shape
        assert mine.data.tobytes() == theirs.data.tobytes(), mine.name
        assert not mine.data.flags.writeable
    return ours


def _types(value: object) -> object:
    return [type(item) for item in value] if isinstance(value, list) else type(value)


@pytest.mark.slow
def test_smollm2_matches_gguf_reader():
    path = locate_embedded(SMOLLM2)
    ours = assert_same_as_gguf_reader(path)
    assert ours.architecture == "llama"
    tokens = ours.fields["tokenizer.ggml.tokens"]
    assert tokens.type == V.ARRAY and tokens.item_type == V.STRING
    assert tokens.count == len(ours.get("tokenizer.ggml.tokens")) == 49152
    # the compatibility names older callers use
    assert ours.reader.tensors is ours.tensors and ours.reader.fields is ours.fields


SCALARS = [  # key, value, GGUF type
    ("t.u8", 200, V.UINT8), ("t.i8", -100, V.INT8), ("t.u16", 60000, V.UINT16),
    ("t.i16", -30000, V.INT16), ("t.u32", 4_000_000_000, V.UINT32),
    ("t.i32", -2_000_000_000, V.INT32),
    ("t.u64", 2**64 - 1, V.UINT64), ("t.i64", -(2**63), V.INT64), ("t.f32", 0.1, V.FLOAT32),
    ("t.f64", 0.1, V.FLOAT64), ("t.true", True, V.BOOL), ("t.false", False, V.BOOL),
    ("t.str", "naïve 日本語 😀", V.STRING), ("t.empty", "", V.STRING),
]
ARRAYS = [  # key, items, item type
    ("a.u8", [0, 1, 255], V.UINT8), ("a.i8", [-128, 127], V.INT8), ("a.u16", [1, 65535], V.UINT16),
    ("a.i16", [-1, 2], V.INT16), ("a.u32", [7] * 5, V.UINT32), ("a.i32", [-5, 5], V.INT32),
    ("a.u64", [2**64 - 1], V.UINT64), ("a.i64", [-(2**63), 3], V.INT64),
    ("a.f32", [0.5, -1e30], V.FLOAT32), ("a.f64", [0.1, 1e300], V.FLOAT64),
    ("a.bool", [True, False, True], V.BOOL),
    ("a.str", ["a", "", "Ġthe", "日本", "<|im_end|>"], V.STRING),
]


def _synthetic(path: Path, alignment: int | None = None) -> dict[str, np.ndarray]:
    writer = GGUFWriter(str(path), "llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value, vtype in SCALARS:
        writer.add_key_value(key, value, vtype)
    for key, items, item_type in ARRAYS:
        writer.add_key_value(key, items, V.ARRAY, sub_type=item_type)
    writer.add_key_value("a.nested", [[1, 2, 3], [4], [5, 6]], V.ARRAY)
    rng = np.random.default_rng(0)
    values = rng.standard_normal((3, 4, 64)).astype(np.float32)
    tensors = {
        "f32": values, "f16": values[0].astype(np.float16), "f64": values[1, 0].astype(np.float64),
        "i8": np.arange(-8, 8, dtype=np.int8).reshape(2, 8), "i16": np.arange(6, dtype=np.int16),
        "i32": np.arange(12, dtype=np.int32).reshape(3, 4), "i64": np.arange(3, dtype=np.int64),
    }
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    for qtype in (Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0):
        writer.add_tensor(qtype.name.lower(), quantize(values[0], qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.mark.parametrize("alignment", [None, 64, 4096])
def test_synthetic_file_matches_gguf_reader(tmp_path: Path, alignment):
    path = tmp_path / "synthetic.gguf"
    tensors = _synthetic(path, alignment)
    ours = assert_same_as_gguf_reader(path, skip=("a.nested",))  # gguf flattens nested arrays
    alignment = alignment or 32
    assert ours.reader.alignment == alignment and ours.reader.data_offset % alignment == 0
    for key, value, vtype in SCALARS:
        expected = float(np.float32(value)) if vtype == V.FLOAT32 else value
        assert ours.get(key) == expected and ours.fields[key].type == vtype, key
    for key, items, item_type in ARRAYS:
        field = ours.fields[key]
        assert (field.type, field.item_type, field.count) == (V.ARRAY, item_type, len(items))
    assert ours.get("a.str") == ARRAYS[-1][1]
    assert ours.get("a.nested") == [[1, 2, 3], [4], [5, 6]]
    assert ours.fields["a.nested"].item_type == V.ARRAY and ours.fields["a.nested"].count == 3
    by_name = {t.name: t for t in ours.tensors}
    for name, array in tensors.items():
        np.testing.assert_array_equal(by_name[name].data, array)
    q8 = by_name["q8_0"]
    assert q8.tensor_type == Q.Q8_0 and q8.data.shape == (4, 68) and q8.shape.tolist() == [64, 4]
    assert ours.tensor_names() == list(by_name)


# ---- hand-built files: what GGUFWriter cannot write, and damage -------------------------------


def _s(text: str | bytes) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data)) + data


def _kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _array(item_type: int, count: int, payload: bytes = b"") -> bytes:
    return struct.pack("<IQ", item_type, count) + payload


def _tensor(name: str, dims: list[int], ttype: int, offset: int = 0) -> bytes:
    return _s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ttype, offset)


def _file(tmp_path: Path, kvs: list[bytes], tensors: list[bytes] = (), data: bytes = b"", *,
          version: int = 3, alignment: int = 32, name: str = "hand.gguf") -> Path:
    head = struct.pack("<4sIQQ", b"GGUF", version, len(tensors), len(kvs))
    head += b"".join(kvs) + b"".join(tensors)
    path = tmp_path / name
    path.write_bytes(head + b"\0" * (-len(head) % alignment) + data)
    return path


ARCH = _kv("general.architecture", V.STRING, _s("llama"))


def _fails(path: Path, match: str) -> str:
    with pytest.raises(ValueError, match=match) as info:
        open_gguf(path)
    assert str(path) in str(info.value)
    return str(info.value)


def test_empty_and_nested_arrays(tmp_path: Path):
    inner = _array(V.INT32, 2, struct.pack("<2i", 1, -2)) + _array(V.STRING, 1, _s("x"))
    path = _file(tmp_path, [ARCH, _kv("empty", V.ARRAY, _array(V.STRING, 0)),
                            _kv("nested", V.ARRAY, _array(V.ARRAY, 2, inner))])
    ours = open_gguf(path)
    assert ours.get("empty") == [] and ours.fields["empty"].count == 0
    assert ours.get("nested") == [[1, -2], ["x"]]


def test_alignment_key(tmp_path: Path):
    values = np.arange(8, dtype=np.float32)
    align = _kv("general.alignment", V.UINT32, struct.pack("<I", 256))
    path = _file(tmp_path, [ARCH, align], [_tensor("w", [8], Q.F32)], values.tobytes(),
                 alignment=256)
    ours = open_gguf(path)
    assert ours.reader.data_offset == 256 and ours.tensors[0].data_offset == 256
    np.testing.assert_array_equal(ours.tensors[0].data, values)


@pytest.mark.parametrize("payload, match", [
    (struct.pack("<Q", 64), "general.alignment has type UINT64"),
    (struct.pack("<I", 48), "not a power of two"),
    (struct.pack("<I", 0), "not a power of two"),
])
def test_bad_alignment(tmp_path: Path, payload, match):
    vtype = V.UINT64 if len(payload) == 8 else V.UINT32
    _fails(_file(tmp_path, [ARCH, _kv("general.alignment", vtype, payload)]), match)


def test_unknown_value_types(tmp_path: Path):
    _fails(_file(tmp_path, [ARCH, _kv("odd", 13, b"\0" * 8)]), "'odd'.*unknown value type 13")
    _fails(_file(tmp_path, [ARCH, _kv("odd", V.ARRAY, _array(99, 1, b"\0" * 8))]),
           "'odd'.*unknown item type 99")


def test_strings_running_past_the_end(tmp_path: Path):
    _fails(_file(tmp_path, [ARCH, _kv("s", V.STRING, struct.pack("<Q", 2**63) + b"abc")]),
           "truncated")
    strings = _s("ok") + struct.pack("<Q", 10_000) + b"short"
    _fails(_file(tmp_path, [ARCH, _kv("toks", V.ARRAY, _array(V.STRING, 2, strings))]),
           "a string of array 'toks'.*past the end")
    _fails(_file(tmp_path, [ARCH, _kv("toks", V.ARRAY, _array(V.STRING, 2**20, _s("a")))]),
           "claims 1048576 strings")
    _fails(_file(tmp_path, [ARCH, _kv("toks", V.ARRAY, _array(V.STRING, 2, _s("a") +
                                                              struct.pack("<Q", 2**64 - 1)))]),
           "past the end")


def test_hostile_array_counts(tmp_path: Path):
    _fails(_file(tmp_path, [ARCH, _kv("big", V.ARRAY, _array(V.UINT8, MAX_ARRAY_ITEMS + 1))]),
           f"claims {MAX_ARRAY_ITEMS + 1} items")
    _fails(_file(tmp_path, [ARCH, _kv("n", V.ARRAY, _array(V.UINT32, 1000, b"\0" * 8))]),
           "truncated.*'n'")
    deep = _array(V.INT32, 0)
    for _ in range(MAX_NESTING):
        deep = _array(V.ARRAY, 1, deep)
    _fails(_file(tmp_path, [ARCH, _kv("deep", V.ARRAY, deep)]), "nests arrays more than")


def test_duplicates(tmp_path: Path):
    _fails(_file(tmp_path, [ARCH, ARCH]), "'general.architecture' appears twice")
    data = np.zeros(8, np.float32).tobytes()
    _fails(_file(tmp_path, [ARCH], [_tensor("w", [8], Q.F32), _tensor("w", [8], Q.F32)], data),
           "tensor 'w' appears twice")


def test_text_that_is_not_utf8(tmp_path: Path):
    _fails(_file(tmp_path, [ARCH, _kv(b"k\xff", V.UINT8, b"\1")]), "metadata key.*not UTF-8")
    # values decode on first use: the file opens, the key fails by name
    path = _file(tmp_path, [ARCH, _kv("toks", V.ARRAY, _array(V.STRING, 2, _s("a") + _s(b"\xff")))])
    ours = open_gguf(path)
    assert ours.fields["toks"].count == 2
    with pytest.raises(ValueError, match="cannot decode 'toks'") as info:
        ours.get("toks")
    assert str(path) in str(info.value)


def test_bad_tensors(tmp_path: Path):
    data = np.zeros(8, np.float32).tobytes()
    _fails(_file(tmp_path, [ARCH], [_tensor("w", [8], 1234)], data), "'w' has unknown type 1234")
    _fails(_file(tmp_path, [ARCH], [_tensor("w", [9], Q.F32)], data), "'w' needs bytes up to")
    _fails(_file(tmp_path, [ARCH], [_tensor("w", [8], Q.F32, offset=2**64 - 1)], data),
           "'w' needs bytes up to")
    _fails(_file(tmp_path, [ARCH], [_tensor("w", [2**40] * 4, Q.F32)], data), "needs bytes up to")
    _fails(_file(tmp_path, [ARCH], [_tensor("q", [16], Q.Q8_0)], data),
           "'q' of shape \\[16\\] does not divide into Q8_0 blocks of 32")
    _fails(_file(tmp_path, [ARCH], [_tensor("w", [2**62, 0], Q.F32)], data), "'w' has shape")
    _fails(_file(tmp_path, [ARCH], [_s("w") + struct.pack("<I", 2**32 - 1)]),
           "dimensions of tensor 'w'")


def test_header_damage(tmp_path: Path):
    _fails(_file(tmp_path, [ARCH], version=1), "has version 1; shoal reads versions 2, 3")
    _fails(_file(tmp_path, [ARCH], version=3 << 24), "is big-endian")
    path = _file(tmp_path, [ARCH])
    path.write_bytes(path.read_bytes()[:20])
    _fails(path, "truncated GGUF file .*20 bytes, no complete header")
    path.write_bytes(b"GGML" + path.read_bytes()[4:])
    _fails(path, "not a GGUF file")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        open_gguf(tmp_path / "missing.gguf")


def test_version_2(tmp_path: Path):
    ours = open_gguf(_file(tmp_path, [ARCH], version=2))
    assert ours.reader.version == ours.get("GGUF.version") == 2
    assert ours.architecture == "llama"
