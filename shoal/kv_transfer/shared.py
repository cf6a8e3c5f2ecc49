"""A fetched KV payload handed to the tensor-parallel ranks of this host through shared memory
instead of inside the step's broadcast (the mp executor: every rank is a process here).

Without this, the payload's bytes ride in the SchedulerOutput that the driver msgpack-encodes
and sends to every rank, and each rank decodes all of them to keep 1/tp (its KV heads). With
it, the consumer receives the payload straight into a file of /dev/shm (`segment`); when a
request is admitted, `to_ranks` gives the file one name per rank (hard links: no copy) and
the step carries only a `SharedRows` handle of a few dozen bytes. Each rank maps its own
name, unlinks it at once and reads only its heads' rows (rows.scatter_rows); the memory goes
back once every rank has let go of its mapping, with no message back to the driver.

Only where the ranks share this host's memory (EngineInfo.ranks_share_memory); the Ray
executor, whose ranks may be on other hosts, keeps the broadcast. Where /dev/shm is missing
or full, `segment` gives None and the payload goes in the broadcast as before. Torch-free.

Names are `shoal-kv-p<pid>n<pid namespace>-<connector>-<n>` (`.<rank>` for the ranks'
links): `sweep` removes what a connector left (a step that failed before every rank mapped
its link); a process killed between a fetch and its step leaves its files behind until the
next connector of this host starts, which removes those whose process is gone
(shoal/temp_folders.py)."""

from __future__ import annotations

import itertools
import mmap
import os
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shoal.kv_transfer.shm_buffers import reserved_mapping
from shoal.temp_folders import owner_tag, sweep_stale

SHM_DIR = Path("/dev/shm")


@dataclass(frozen=True)
class SharedRows:
    """A payload's bytes in shared memory: rank r maps `<path>.<r>` (msgpack sends this as a
    map, so a rank gets a dict with these keys)."""

    path: str
    nbytes: int


class _Segment(mmap.mmap):
    """A writable shared mapping that remembers its file (the payload's buffer on the
    consumer, until admission)."""

    path: str


class SegmentMaker:
    """One connector's segments: unique names under `directory` (None: /dev/shm, when this
    host has it)."""

    def __init__(self, directory: Path | None = None):
        directory = directory if directory is not None else SHM_DIR
        self.directory = directory if directory.is_dir() else None
        if self.directory is not None:  # segments a killed engine left (and its ranks' links)
            sweep_stale("kv", str(self.directory))
        self.prefix = f"shoal-kv-{owner_tag()}-{uuid.uuid4().hex[:8]}-"
        self._serial = itertools.count()

    def segment(self, nbytes: int) -> memoryview | None:
        """A writable buffer of nbytes backed by a file of its own; None where shared memory
        cannot hold it (no /dev/shm, not enough room, an empty payload)."""
        if self.directory is None or nbytes <= 0:
            return None
        path = self.directory / f"{self.prefix}{next(self._serial)}"
        seg = reserved_mapping(str(path), nbytes, _Segment)
        if seg is None:
            return None
        seg.path = str(path)
        weakref.finalize(seg, _unlink, str(path))  # dropped before admission: gone with it
        return memoryview(seg)

    def sweep(self) -> int:
        """Removes this connector's files still there; how many."""
        if self.directory is None:
            return 0
        found = list(self.directory.glob(f"{self.prefix}*"))
        for path in found:
            path.unlink(missing_ok=True)
        return len(found)


def to_ranks(data: Any, world: int) -> Any:
    """What a KVLoad carries to `world` ranks: a SharedRows handle for a segment's buffer
    (its file renamed into one link per rank), anything else unchanged."""
    seg = memoryview(data).obj if isinstance(data, memoryview) else None
    if not isinstance(seg, _Segment):
        return data
    links = [f"{seg.path}.{rank}" for rank in range(world)]
    try:
        for link in links:
            os.link(seg.path, link)
    except OSError:  # (a file system without hard links): the bytes go in the broadcast
        for link in links:
            _unlink(link)
        return data
    _unlink(seg.path)  # the links hold the memory now; this process's mapping goes with data
    return SharedRows(seg.path, len(seg))


def open_rows(data: Any, rank: int) -> Any:
    """The buffer a rank reads a KVLoad's rows from: its link of a SharedRows handle (an
    object on the driver, a dict after msgpack), mapped read-only and unlinked at once;
    anything else (the bytes themselves) unchanged."""
    if isinstance(data, dict) and data.keys() == {"path", "nbytes"}:
        data = SharedRows(**data)
    if not isinstance(data, SharedRows):
        return data
    path = f"{data.path}.{rank}"
    fd = os.open(path, os.O_RDONLY)
    try:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # one call, not a fault a page
        rows = mmap.mmap(fd, data.nbytes, flags=flags, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
        _unlink(path)
    return rows


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
