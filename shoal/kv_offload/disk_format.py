"""One block per file: a 64-byte header, then the payload bytes.

The header carries a magic, the layout version, the store key digest (model, dtype, block
size, per-layer shape), the block's hash, the payload length and an xxhash of the payload.
Files are written under a temporary name and renamed, so a reader never sees a half-written
file under a real name; a file damaged anyway (disk error, crash before the data reached the
disk: there is no fsync) fails one of the checks at load and is never served."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import torch
import xxhash

from shoal.kv_offload.layout import LAYOUT_VERSION

MAGIC = b"SHOALKV\x00"
_HEADER = struct.Struct("<8sI16s16sQQ4x")  # magic, version, key digest, hash, length, checksum
HEADER_BYTES = _HEADER.size
assert HEADER_BYTES == 64
SUFFIX = ".kv"
TMP_MARK = ".tmp-"


class DamagedBlockError(Exception):
    """The file exists but cannot be trusted; the caller deletes it."""


def _byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (any dtype, bfloat16 included)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("payload must be a contiguous CPU tensor")
    return memoryview(t.view(-1).view(torch.uint8).numpy())


def file_name(block_hash: bytes) -> str:
    return block_hash.hex() + SUFFIX


def write_block(path: Path, key_digest: bytes, block_hash: bytes, payload: torch.Tensor) -> int:
    """Writes atomically (temporary name + rename); returns the file size."""
    data = _byte_view(payload)
    header = _HEADER.pack(MAGIC, LAYOUT_VERSION, key_digest, block_hash, data.nbytes,
                          xxhash.xxh3_64_intdigest(data))
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return HEADER_BYTES + data.nbytes


def read_block(path: Path, key_digest: bytes, block_hash: bytes, dst: torch.Tensor) -> None:
    """Reads straight into dst; raises FileNotFoundError (a miss) or DamagedBlockError. dst
    holds garbage after a failure, so the caller must not use it."""
    out = _byte_view(dst)
    with open(path, "rb") as f:
        raw = f.read(HEADER_BYTES)
        if len(raw) != HEADER_BYTES:
            raise DamagedBlockError("truncated header")
        magic, version, digest, stored_hash, length, checksum = _HEADER.unpack(raw)
        if magic != MAGIC or version != LAYOUT_VERSION:
            raise DamagedBlockError("not a shoal KV block of this layout version")
        if digest != key_digest:
            raise DamagedBlockError("written for another model or configuration")
        if stored_hash != block_hash:
            raise DamagedBlockError("holds another block")
        if length != out.nbytes:
            raise DamagedBlockError(f"payload is {length} bytes, expected {out.nbytes}")
        got = f.readinto(out)
        if got != out.nbytes:
            raise DamagedBlockError(f"truncated payload ({got} of {out.nbytes} bytes)")
        if f.read(1):
            raise DamagedBlockError("trailing bytes")
    if xxhash.xxh3_64_intdigest(out) != checksum:
        raise DamagedBlockError("checksum mismatch")
