"""One block per file: a 64-byte header, then the payload bytes.

The header carries a magic, the layout version, the store key digest (model, dtype, block
size, per-layer shape), the block's hash, the payload length and an xxhash of the payload.
Files are written under a temporary name and renamed, so a reader never sees a half-written
file under a real name (a process killed mid-write leaves only the temporary file, which the
next start-up deletes; a full disk fails the write, which deletes it at once); a file damaged
anyway (disk error, power loss before the data reached the disk: there is no fsync) fails one
of the checks at load and is never served. Files are private to the user (mode 0600): KV
blocks are a function of the prompts."""

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


def _header_hash(block_hash: bytes) -> bytes:
    """The 16 bytes of the header that name the block: its hash, or a digest of a longer key
    (a hybrid's tagged key, shoal/kv_cache/block_tables.py)."""
    return block_hash if len(block_hash) == 16 else xxhash.xxh3_128(block_hash).digest()


def write_block(path: Path, key_digest: bytes, block_hash: bytes, payload: torch.Tensor) -> int:
    """Writes atomically (temporary name + rename); returns the file size."""
    data = _byte_view(payload)
    header = _HEADER.pack(MAGIC, LAYOUT_VERSION, key_digest, _header_hash(block_hash),
                          data.nbytes,
                          xxhash.xxh3_64_intdigest(data))
    tmp = path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _writev_full(fd, [memoryview(header), data])
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return HEADER_BYTES + data.nbytes


def _writev_full(fd: int, bufs: list[memoryview]) -> None:
    """Writes bufs in order, again from where the kernel stopped after a short write (an
    error such as ENOSPC raises)."""
    views = [b.cast("B") for b in bufs]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def read_block(path: Path, key_digest: bytes, block_hash: bytes, dst: torch.Tensor) -> None:
    """Reads straight into dst (no intermediate buffer: one scatter read fills the header and
    dst); raises FileNotFoundError (a miss) or DamagedBlockError. dst holds garbage after a
    failure, so the caller must not use it. Safe on any thread (disk_reader.py runs it on a
    pool, checksum included)."""
    out = _byte_view(dst)
    header = bytearray(HEADER_BYTES)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES:
            raise DamagedBlockError("truncated header")
        got = _readv_full(fd, [memoryview(header), out])
    finally:
        os.close(fd)
    magic, version, digest, stored_hash, length, checksum = _HEADER.unpack(header)
    if magic != MAGIC or version != LAYOUT_VERSION:
        raise DamagedBlockError("not a shoal KV block of this layout version")
    if digest != key_digest:
        raise DamagedBlockError("written for another model or configuration")
    if stored_hash != _header_hash(block_hash):
        raise DamagedBlockError("holds another block")
    if length != out.nbytes:
        raise DamagedBlockError(f"payload is {length} bytes, expected {out.nbytes}")
    if got < HEADER_BYTES + out.nbytes:
        raise DamagedBlockError(f"truncated payload ({got - HEADER_BYTES} of {out.nbytes} bytes)")
    if size > HEADER_BYTES + out.nbytes:
        raise DamagedBlockError("trailing bytes")
    if xxhash.xxh3_64_intdigest(out) != checksum:
        raise DamagedBlockError("checksum mismatch")


def _readv_full(fd: int, bufs: list[memoryview]) -> int:
    """Fills bufs from the start of the file, in one preadv unless the kernel returns short
    (then again from where it stopped); returns the bytes read (less only at end of file)."""
    views = [b.cast("B") for b in bufs]
    total = 0
    while views:
        n = os.preadv(fd, views, total)
        if n == 0:
            break
        total += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]
    return total
