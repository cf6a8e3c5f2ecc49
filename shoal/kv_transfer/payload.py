"""A prompt's KV as it leaves one engine and enters another: a small layout (which layers, what
shape, what dtype) and one contiguous host buffer of raw bytes (torch-free: the connector
keeps, sends and receives these without looking inside).

The buffer holds every layer's rows one after another, layer i as [planes, N, H, width]
bytes (planes: K and V, or MLA's one latent row; N tokens; H KV heads; width: bytes of one
head's row). It is read out of the paged cache once (rows.gather_rows), sent as is (a short
msgpack header, then the bytes: transport.py) and received straight into a buffer of its
size, pinned where the engine runs on CUDA so that the copies to the device are
asynchronous (host_buffer)."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from shoal.core.kv_connector_plan import KVLayout
from shoal.kv_transfer.shm_buffers import shared_array

__all__ = ["KVLayout", "KVPayload", "host_buffer"]


@dataclass
class KVPayload:
    """A layout and its bytes. `ready` (None: ready now) blocks until the bytes are valid: a
    readout from the device may still be on its way into the buffer when the step returns."""

    layout: KVLayout
    data: Any  # a writable or read-only buffer of layout.nbytes bytes (memoryview, numpy)
    ready: Callable[[], None] | None = None

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes

    def wait(self) -> None:
        if self.ready is not None:
            self.ready()
            self.ready = None


class HostBufferPool:
    """Plain host buffers, recycled: a buffer handed out goes back to the pool when the last
    view of it dies (weakref.finalize), and the next one of its size class takes it. Fresh
    memory is slow to fill here: the kernel faults in every page under the socket's copy
    (seconds for 512 MiB on a busy VM, against 0.2 s into pages already mapped). Sizes round
    up to a quarter of their power of two (at most 25% spare); at most `max_free_bytes` wait
    in the pool, the rest is freed. `shared`: the buffers are files of /dev/shm where it has
    room (shm_buffers.py: a consumer on this host reads a kept payload there, not over TCP),
    else plain memory."""

    def __init__(self, max_free_bytes: int = 4 << 30, shared: bool = False):
        self.max_free_bytes = max_free_bytes
        self.shared = shared
        self._free: dict[int, list[np.ndarray]] = {}
        self._free_bytes = 0
        self._lock = threading.Lock()

    @staticmethod
    def size_class(nbytes: int) -> int:
        step = max(1 << 20, 1 << max(0, nbytes.bit_length() - 3))
        return -(-nbytes // step) * step

    def get(self, nbytes: int) -> memoryview:
        size = self.size_class(nbytes)
        with self._lock:
            free = self._free.get(size)
            base = free.pop() if free else None
            if base is not None:
                self._free_bytes -= size
        if base is None and self.shared:
            base = shared_array(size)
        if base is None:
            base = np.empty(size, dtype=np.uint8)
        view = base[:nbytes]
        weakref.finalize(view, self._put, base)
        return memoryview(view)

    def _put(self, base: np.ndarray) -> None:
        with self._lock:
            if self._free_bytes + base.nbytes <= self.max_free_bytes:
                self._free.setdefault(base.nbytes, []).append(base)
                self._free_bytes += base.nbytes

    @property
    def free_bytes(self) -> int:
        return self._free_bytes


_POOL = HostBufferPool(shared=True)


def host_buffer(nbytes: int, pinned: bool = False) -> memoryview:
    """A writable, uninitialized host buffer: page-locked (through torch's caching host
    allocator, which reuses freed ones) when pinned, else from the recycling pool above (in
    /dev/shm where it has room: a consumer on this host can read it by name)."""
    if pinned:
        import torch  # (only engines on CUDA ask: the connector module stays torch-free)

        return memoryview(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy())
    return _POOL.get(nbytes)
