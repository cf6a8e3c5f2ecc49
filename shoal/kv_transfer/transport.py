"""How KV bytes move between engines: one request and one reply per TCP connection. Each
message is a length-prefixed msgpack header; a reply whose header names `nbytes` is followed
by that many raw bytes, sent from the producer's buffer as they are (no encoding, no copy)
and received straight into a buffer the consumer allocates for them (recv_into). Kept behind
two functions (KVServer, fetch) so that another transport (NIXL/RDMA) can take their place.

Same host: a client that can read this host's shared files says so (fetch(shared=True)), and
a handler that lets it (Reply.share) names, in the header, the /dev/shm file and offset
holding the bytes (shm_buffers.py: a CPU engine's KV payloads live in such files) instead of
sending them; a body elsewhere (a pinned one) still goes on the socket. The client copies them out of the file with one
call and answers one byte: 1, done (the server lets go of the body), or 0, it could not
open the file (another host, another /dev/shm): the bytes then follow on the socket as
usual. A client that does not ask gets the bytes on the socket."""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from shoal.kv_transfer.shm_buffers import SharedPlace, locate, read_shared

logger = logging.getLogger(__name__)

_LEN = struct.Struct(">Q")
MAX_HEADER = 16 << 20  # headers are small; the bytes come after them
MAX_BODY = 64 << 30  # a prompt's KV: tens of MiB to a few GiB
SOCKET_BUFFER = 32 << 20  # asked of the kernel (it caps at net.core.[rw]mem_max)
_CHUNK = 64 << 20  # at most this many bytes per recv_into (the GIL is let go in each)
_DONE, _SEND = b"\x01", b"\x00"  # a shared-file reader's answer: read it / send the bytes


@dataclass
class Reply:
    """What a server handler answers: a header and, optionally, raw bytes after it (`ready`,
    when set, is called first: it blocks until the bytes are valid)."""

    header: dict[str, Any]
    body: Any = None  # a buffer (memoryview, bytes, numpy array) or None
    ready: Callable[[], None] | None = None
    share: bool = False  # the client reads this host's shared files: name the body's file


def _shared_place(body: memoryview) -> tuple[SharedPlace, Any] | None:
    """The shared file holding the body, and what keeps it there until the client has read
    it; None where the body is not in one. A body elsewhere (CUDA's pinned buffers) is sent
    on the socket: staging it into a shared file costs a copy at each end, and measured on a
    CPU host that was no faster than TCP at 4 fetches at once (benchmarks/kv_transfer_bench.py)."""
    place = locate(body)
    return None if place is None else (place, body)


def _tune(sock: socket.socket) -> None:
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER)
        except OSError:
            pass
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _send_header(sock: socket.socket, obj: Any) -> None:
    data = msgspec.msgpack.encode(obj)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, _CHUNK))
        if not k:
            raise ConnectionError(f"the peer closed the connection after {got} of {n} bytes")
        got += k


def _recv_header(sock: socket.socket) -> Any:
    head = bytearray(_LEN.size)
    _recv_into(sock, memoryview(head))
    (n,) = _LEN.unpack(head)
    if n > MAX_HEADER:
        raise ConnectionError(f"a {n}-byte header is over the limit of {MAX_HEADER}")
    data = bytearray(n)
    _recv_into(sock, memoryview(data))
    return msgspec.msgpack.decode(data)


def _byte_view(body: Any) -> memoryview:
    view = memoryview(body)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class KVServer:
    """Answers each connection's one request with handler(request) -> Reply, on a thread of
    its own (several consumers fetch at once)."""

    def __init__(self, host: str, port: int, handler: Callable[[Any], Reply]):
        outer = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock = self.request
                try:
                    _tune(sock)
                    reply = outer.handler(_recv_header(sock))
                    body = shared = None
                    if reply.body is not None:
                        if reply.ready is not None:
                            reply.ready()
                        body = _byte_view(reply.body)
                        reply.header["nbytes"] = len(body)
                        shared = _shared_place(body) if reply.share and len(body) else None
                        if shared is not None:
                            reply.header["shared"] = {"path": shared[0].path,
                                                      "offset": shared[0].offset}
                    _send_header(sock, reply.header)
                    if shared is not None:
                        answer = sock.recv(1)
                        if answer != _SEND:  # read (or the client is gone)
                            return
                    if body is not None:
                        sock.sendall(body)
                except Exception as e:  # a broken client must not take the server down
                    logger.warning("KV server: a request failed (%s: %s)", type(e).__name__, e)

        self.handler = handler
        socketserver.ThreadingTCPServer.allow_reuse_address = True
        self.server = socketserver.ThreadingTCPServer((host, port), _Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, name="kv-server",
                                       daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def fetch(host: str, port: int, request: Any, timeout: float,
          alloc: Callable[[int], memoryview] | None = None,
          shared: bool = False) -> tuple[Any, memoryview | None]:
    """One request to a KVServer: its reply header and the bytes after it (None when the
    reply has none), received into alloc(nbytes) (default: a bytearray). Raises OSError /
    ConnectionError when the server cannot answer whole within `timeout` seconds a
    receive. shared: the request (a dict) says this client reads shared files of this host,
    and the bytes are copied out of the one the reply names, if it can be opened."""
    if shared and isinstance(request, dict):
        request = {**request, "shared": True}
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        _tune(sock)
        _send_header(sock, request)
        header = _recv_header(sock)
        nbytes = header.get("nbytes") if isinstance(header, dict) else None
        if nbytes is None:
            return header, None
        if type(nbytes) is not int or not 0 <= nbytes <= MAX_BODY:
            raise ConnectionError(f"a reply of {nbytes!r} bytes is over the limit")
        buf = alloc(nbytes) if alloc is not None else memoryview(bytearray(nbytes))
        view = _byte_view(buf)
        if len(view) != nbytes:
            raise ValueError(f"alloc({nbytes}) gave {len(view)} bytes")
        if shared and _read_shared(header.get("shared"), view):
            sock.sendall(_DONE)
            return header, buf
        if shared and "shared" in header:
            sock.sendall(_SEND)
        _recv_into(sock, view)
        return header, buf


def _read_shared(where: Any, view: memoryview) -> bool:
    """Copies the bytes out of the shared file a reply names; False where it names none or
    it cannot be read here (the bytes then come over the socket)."""
    if not isinstance(where, dict):
        return False
    try:
        read_shared(SharedPlace(str(where["path"]), int(where["offset"]), len(view)), view)
    except (KeyError, TypeError, ValueError, OSError) as e:
        logger.info("KV fetch: the shared file %s cannot be read here (%s): over TCP",
                    where.get("path"), e)
        return False
    return True
