"""Host buffers that live in files of /dev/shm, so that another process of this host can read
them by name: the same-host path of a KV fetch (transport.py), which hands the consumer a
file name and an offset instead of pushing the bytes through loopback TCP.

Over TCP a 512 MiB payload crosses the kernel twice in small pieces (the socket buffer:
a few MiB), and each piece takes the interpreter lock back; an engine's step loop holding it
(a busy loop of empty steps while a fetch is in flight) stalls every one of them. Through a
shared file the consumer maps the producer's buffer once and copies it with one call that
lets go of the lock (numpy), at memory speed.

The producer's payload buffers come from HostBufferPool (payload.py), whose bases are such
files (`shared_array`), recycled across requests: a file's pages are faulted in once, not per
request. `locate` finds the file and offset holding a buffer; `read_shared` maps a file
read-only and copies its bytes out. Names follow shoal/temp_folders.py's owner tags, so the
files a killed engine left are removed by the next connector of this host (shared.py's
SegmentMaker sweeps kind "kv"). Torch-free."""

from __future__ import annotations

import ipaddress
import itertools
import mmap
import os
import stat
import threading
import uuid
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shoal.temp_folders import owner_tag

SHM_DIR = Path("/dev/shm")
_GRANULE = mmap.ALLOCATIONGRANULARITY


@dataclass(frozen=True)
class SharedPlace:
    """Where a buffer's bytes are: `nbytes` from `offset` of the file `path`."""

    path: str
    offset: int
    nbytes: int


class _Files:
    """This process's live shared files by their mapping's address (to find a buffer's)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_address: dict[int, tuple[int, str]] = {}  # address -> (size, path)
        self.prefix = ""
        self.serial = itertools.count()

    def name(self) -> str:
        if not self.prefix or not self.prefix.startswith(f"shoal-kv-{owner_tag()}-"):
            self.prefix = f"shoal-kv-{owner_tag()}-{uuid.uuid4().hex}-buf"  # (after fork)
        return f"{self.prefix}{next(self.serial)}"


_FILES = _Files()


def shared_array(nbytes: int, directory: Path = SHM_DIR) -> np.ndarray | None:
    """A writable uint8 array of nbytes over a new file of `directory`, its pages reserved and
    mapped now (a tmpfs that runs out under a write would kill the process: SIGBUS); None
    where that cannot be had (no such directory, not enough room). The file goes with the
    array's last view."""
    if nbytes <= 0 or not directory.is_dir():
        return None
    path = str(directory / _FILES.name())
    mapping = reserved_mapping(path, nbytes)
    if mapping is None:
        return None
    array = np.frombuffer(mapping, dtype=np.uint8)
    address = array.ctypes.data
    with _FILES.lock:
        _FILES.by_address[address] = (nbytes, path)
    weakref.finalize(array, _forget, address, path)
    return array


def reserved_mapping(path: str, nbytes: int, mapping: Callable[..., Any] = mmap.mmap
                     ) -> Any | None:
    """A new file `path` (mode 0600, never one already there) of nbytes with its pages
    reserved now (a tmpfs that runs out under a write would kill the process: SIGBUS),
    mapped shared and populated: mapping(fd, nbytes, flags=...), mmap.mmap or a subclass;
    None, the file removed, where that cannot be had."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return None
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return mapping(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    except OSError:
        _unlink(path)
        return None
    finally:
        os.close(fd)


def locate(buf: Any) -> SharedPlace | None:
    """The shared file and offset holding a buffer's bytes (contiguous), or None: not in one
    of this process's shared arrays."""
    try:
        view = np.frombuffer(buf, dtype=np.uint8)
    except (TypeError, ValueError):
        return None
    address, n = view.ctypes.data, view.nbytes
    with _FILES.lock:
        for base, (size, path) in _FILES.by_address.items():
            if base <= address and address + n <= base + size:
                return SharedPlace(path, address - base, n)
    return None


def read_shared(place: SharedPlace, into: Any, directory: Path = SHM_DIR) -> None:
    """Copies a shared file's bytes (another process's buffer) into `into` (a writable buffer
    of place.nbytes). OSError when the file cannot be opened (a link) or is shorter;
    ValueError when `into` has another size or the file is not a shoal KV file of `directory`:
    a peer names it, so nothing else of this host is opened, and the file must be a regular
    file of this user that no one else may write (mode 0600)."""
    path = Path(place.path)
    if path.parent != directory or not path.name.startswith("shoal-kv-"):
        raise ValueError(f"{place.path} is not a shoal KV file of {directory}")
    dst = np.frombuffer(into, dtype=np.uint8)
    if dst.nbytes != place.nbytes:
        raise ValueError(f"a buffer of {dst.nbytes} bytes for {place.nbytes} shared bytes")
    if place.offset < 0 or place.nbytes < 0:
        raise ValueError(f"a shared place at offset {place.offset} of {place.nbytes} bytes")
    if not place.nbytes:
        return
    start = place.offset // _GRANULE * _GRANULE  # mmap offsets are whole pages
    length = place.offset - start + place.nbytes
    # never a link, a FIFO (open would block) or a file another user could write or cut
    # short (a truncation under the mapping is a SIGBUS)
    fd = os.open(place.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ValueError(f"{place.path} is not a regular file of this user, mode 0600")
        if st.st_size < start + length:
            raise OSError(f"{place.path} holds fewer than {start + length} bytes")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # one call, not a fault a page
        mapping = mmap.mmap(fd, length, flags=flags, prot=mmap.PROT_READ, offset=start)
    finally:
        os.close(fd)
    try:
        src = np.frombuffer(mapping, dtype=np.uint8)[place.offset - start:]
        np.copyto(dst, src)  # (numpy lets go of the interpreter lock for the copy)
        del src
    finally:
        mapping.close()


def is_loopback(host: str) -> bool:
    """A peer address of this host's loopback (the only peers whose files are read)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _forget(address: int, path: str) -> None:
    with _FILES.lock:
        _FILES.by_address.pop(address, None)
    _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
