"""Open a GGUF file and read its metadata, turning every failure into an error that names the file."""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.loader.gguf_reader import (
    HEADER,
    GGUFContents,
    GGUFField,
    GGUFTensor,
    parse_gguf,
)

__all__ = ["GGUFField", "GGUFFile", "GGUFTensor", "open_gguf"]


@dataclass
class GGUFFile:
    """A memory-mapped GGUF file: metadata is decoded on demand, tensor data stays on disk."""

    path: Path
    reader: GGUFContents  # the name older callers use (`.reader.tensors`, `.reader.fields`)

    @property
    def tensors(self) -> list[GGUFTensor]:
        return self.reader.tensors

    @property
    def fields(self) -> dict[str, GGUFField]:
        return self.reader.fields

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
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
        return [tensor.name for tensor in self.tensors]


def open_gguf(path: str | Path) -> GGUFFile:
    """Parse the header of a GGUF file (tensor data is only mapped, not read)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with path.open("rb") as handle:
        size = path.stat().st_size
        # mmap refuses empty files; one too short for a header is read so the parser names it
        buf = (handle.read() if size < HEADER.size
               else mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ))
    return GGUFFile(path=path, reader=parse_gguf(buf, str(path)))
