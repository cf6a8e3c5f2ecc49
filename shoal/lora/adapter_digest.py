"""What identifies an adapter's weights: the SHA-256 of its two files' bytes (torch-free).

The prefix cache keys an adapter's KV blocks by it (LoRARequest.content_digest, set by the
engine core when a request arrives), so an id and folder whose files were saved again with
other weights never meet blocks computed with the old ones, while files saved again with the
same bytes still hit. It is a content hash rather than a load counter because the engine core
and the worker ranks are separate processes (possibly machines) that each read the folder:
they agree on the bytes without talking, and a rank checks what it reads against the digest
the scheduler keyed the request's blocks with (read_verified)."""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import BinaryIO

_CHUNK = 1 << 22
_VERSION = b"shoal-lora-digest-1"


def file_stamp(file: Path) -> tuple[int, int, int, int]:
    """What changes whenever the file is written or replaced: its inode, size, mtime and
    ctime (a copy that keeps the old mtime, cp -p or rsync -t, still moves the ctime)."""
    st = file.stat()
    return st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _start(config: bytes) -> hashlib._Hash:
    h = hashlib.sha256(_VERSION)
    h.update(len(config).to_bytes(8, "little"))  # the config first, framed; the weights last
    h.update(config)
    return h


def digest_of(config: bytes, weights: bytes) -> str:
    h = _start(config)
    h.update(weights)
    return h.hexdigest()


def read_header(f: BinaryIO, file: Path) -> tuple[bytes, bytes]:
    """The safetensors file's length prefix and JSON header, read from `f` (at its start)."""
    head = f.read(8)
    try:
        (size,) = struct.unpack("<Q", head)
    except struct.error:
        raise ValueError(f"LoRA adapter weights {str(file)!r} are not a safetensors file "
                         "(shorter than its 8-byte header length)") from None
    if size > 100 << 20:
        raise ValueError(f"LoRA adapter weights {str(file)!r} are not a safetensors file "
                         "(header larger than 100 MiB)")
    return head, f.read(size)


def digest_and_header(config: bytes, weights_file: Path) -> tuple[str, bytes]:
    """The digest of the config bytes and the weights file, streamed (an adapter may be GBs),
    and the weights' JSON header from the same read: header and digest describe one version
    of the file even if it is replaced meanwhile (an open file keeps its inode)."""
    h = _start(config)
    with open(weights_file, "rb") as f:
        head, header = read_header(f, weights_file)
        h.update(head)
        h.update(header)
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest(), header


def read_verified(folder: Path, config_name: str, weights_name: str, digest: str
                  ) -> bytes:
    """The weights file's bytes, checked to be the version `digest` names (with the config):
    ValueError when the folder was saved again since its digest was taken."""
    config = (folder / config_name).read_bytes()
    weights = (folder / weights_name).read_bytes()
    if digest_of(config, weights) != digest:
        raise ValueError(changed_message(str(folder)))
    return weights


def changed_message(folder: str) -> str:
    return (f"LoRA adapter {folder!r}: its files changed after the request arrived (the "
            "engine keyed the request's KV cache to the adapter as it was then); send the "
            "request again")

