"""Malformed GGUF files: a structure-aware mutator over a valid file (every length, count,
type code and dimension of the header is a target, besides random bytes and truncations), and
the harness that feeds one file to the whole GGUF loading path (header, config, tokenizer,
tensor plan and dequantized weights). Shared by test_gguf_fuzz.py and
benchmarks/fuzz_gguf.py (which also runs atheris over the same harness)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from gguf import GGUFReader

SPECIAL = [0, 1, 2**7, 2**8 - 1, 2**15, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
           2**40, 2**62, 2**63 - 1, 2**63, 2**64 - 1]


@dataclass(frozen=True)
class Slot:
    """An integer in the file's header: its byte offset and width."""

    offset: int
    width: int


def header_slots(path: Path) -> list[Slot]:
    """Every integer part (lengths, type codes, counts, dimensions, offsets, scalar values)
    of every metadata item and tensor description, plus the file header's counts."""
    reader = GGUFReader(path)
    slots = [Slot(4, 4), Slot(8, 8), Slot(16, 8)]  # version, tensor count, metadata count
    fields = list(reader.fields.values()) + [t.field for t in reader.tensors]
    for f in fields:
        at = f.offset
        for part in f.parts:
            if part.dtype.kind in "ui" and part.size == 1 and part.itemsize in (4, 8):
                slots.append(Slot(at, part.itemsize))
            elif part.dtype.kind in "ui" and part.itemsize == 8:  # tensor dims
                slots += [Slot(at + 8 * i, 8) for i in range(part.size)]
            at += part.nbytes
    return slots


def mutate(data: bytes, slots: list[Slot], rng: random.Random) -> bytes:
    b = bytearray(data)
    kind = rng.randrange(6)
    if kind <= 2:  # a header integer: a special value, a small change or random
        for _ in range(1 + (kind == 2) * rng.randrange(3)):
            s = rng.choice(slots)
            old = int.from_bytes(b[s.offset:s.offset + s.width], "little")
            new = rng.choice([rng.choice(SPECIAL), old + rng.randrange(-3, 4),
                              rng.randrange(2 ** (8 * s.width))])
            b[s.offset:s.offset + s.width] = (new % 2 ** (8 * s.width)).to_bytes(s.width,
                                                                                 "little")
    elif kind == 3:  # random bytes anywhere
        for _ in range(rng.randrange(1, 16)):
            b[rng.randrange(len(b))] = rng.randrange(256)
    elif kind == 4:  # truncated
        del b[rng.randrange(len(b)):]
    else:  # a block of the header duplicated or removed
        head = max(s.offset for s in slots)
        i, n = rng.randrange(head), rng.randrange(1, 64)
        b[i:i] = b[i:i + n] if rng.random() < 0.5 else b""
        if rng.random() < 0.5:
            del b[i:i + n]
    return bytes(b)


def load_everything(path: Path) -> None:
    """The whole GGUF loading path; a malformed file must raise ValueError and nothing else."""
    from shoal.loader.gguf_loader import load_gguf
    from shoal.loader.gguf_tokenizer import build_gguf_tokenizer

    model = load_gguf(path)
    for _name, _tensor in model.weights():
        pass
    build_gguf_tokenizer(model.file)


def write_seed(path: Path) -> Path:
    """A small valid GGUF (tests/loader/gguf_factory.py: one layer, byte-level tokenizer)."""
    from gguf_factory import TinySpec, write_tiny_gguf

    write_tiny_gguf(path, TinySpec(layers=1, hidden=32, heads=2, kv_heads=1, intermediate=48))
    return path
