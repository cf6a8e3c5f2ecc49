"""How KV bytes move between engines: one request and one reply per TCP connection, each a
length-prefixed msgpack message. Kept behind two functions (serve, fetch) so that another
transport (shared memory on one host, NIXL/RDMA) can take their place."""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
from collections.abc import Callable
from typing import Any

import msgspec

logger = logging.getLogger(__name__)

_LEN = struct.Struct(">Q")
MAX_MESSAGE = 64 << 30  # a prompt's KV: tens of MiB to a few GiB


def _send(sock: socket.socket, obj: Any) -> None:
    data = msgspec.msgpack.encode(obj)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ConnectionError("the peer closed the connection mid-message")
        got += k
    return bytes(buf)


def _recv(sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > MAX_MESSAGE:
        raise ConnectionError(f"a {n}-byte message is over the limit")
    return msgspec.msgpack.decode(_recv_exact(sock, n))


class KVServer:
    """Answers each connection's one request with handler(request) on a thread of its own."""

    def __init__(self, host: str, port: int, handler: Callable[[Any], Any]):
        outer = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                try:
                    _send(self.request, outer.handler(_recv(self.request)))
                except Exception:  # a broken client must not take the server down
                    logger.exception("KV server: a request failed")

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


def fetch(host: str, port: int, request: Any, timeout: float) -> Any:
    """One request to a KVServer; raises OSError / ConnectionError when it cannot answer."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(timeout)
        _send(sock, request)
        return _recv(sock)
