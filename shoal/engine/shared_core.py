"""One engine-core process shared by several frontends (`shoal serve --api-server-count N`).

    API process 0 --DEALER--\\                                        /--PUSH--> its PULL
    API process 1 --DEALER---> ROUTER socket --> SharedCoreProc ---PUSH--> its PULL
    supervisor    --DEALER--/   (a client is its ZMQ identity)      \\--PUSH--> its PULL

Outputs go back on a socket of their own per client (the address in its Hello), not through
the ROUTER: a client socket that both sends and receives would share one edge-triggered
ZMQ fd between its writer and its asyncio reader, and a send could swallow a read wake-up.

Each client says Hello (its pid) first and gets the Ready message back once the core is
built. Its request ids live in its own namespace: the engine sees "c<k>:<id>", so two API
processes may use the same id, and an abort only ever reaches the client's own requests.
Every step's outputs are split by client; the step's statistics go to every client (each
uses the engine's queue length for its admission check). Utility calls (sleep, pause,
collective_rpc, ...) act on the whole engine and are answered to their caller alone.

A client that exits says Detach; one that dies is noticed through a pidfd on its pid. Either
way its live requests are aborted and the engine goes on serving the others. Only the owner
(the supervisor that started the engine) may stop it: another client's Shutdown is a Detach.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from shoal.core.types import EngineCoreOutputs
from shoal.engine.core_messages import (
    AbortRequests,
    AddRequest,
    CoreOutputs,
    Ready,
    Rejection,
    Shutdown,
    StartupFailed,
    UtilityCall,
)
from shoal.engine.core_proc import EngineCoreProc, _build_core, _exit_at_once, _serve
from shoal.engine.engine_args import EngineArgs

logger = logging.getLogger(__name__)

SEP = ":"  # between a client's tag and its own request id: the first one splits them
LIVENESS_CHECK_S = 1.0  # without pidfds: how often clients' pids are checked


class Hello(msgspec.Struct, tag="hello", array_like=True):
    """A client's first message: the pid the engine watches; the owner may stop the engine."""

    pid: int
    output_address: str  # where its PULL socket listens for what the engine sends it
    owner: bool = False


class Detach(msgspec.Struct, tag="detach", array_like=True):
    """The client leaves (its API process shuts down): its requests are aborted."""


SharedInputMessage = AddRequest | AbortRequests | UtilityCall | Shutdown | Hello | Detach


@dataclass(eq=False)
class _Client:
    identity: bytes
    tag: str  # "c<k>": its request ids are "c<k>:<id>" in the core
    pid: int
    owner: bool
    out: zmq.Socket  # PUSH, connected to the client's output address
    pidfd: int | None = None
    live: set[str] = field(default_factory=set)  # its requests in the core (namespaced ids)


def _open_pidfd(pid: int) -> int | None:
    """A file descriptor that turns readable when `pid` exits (Linux 5.3+), else None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class SharedCoreProc(EngineCoreProc):
    """EngineCoreProc over a ROUTER socket: `input_socket` and `output_socket` are the same."""

    def __init__(self, core: Any, input_socket: zmq.Socket, output_socket: zmq.Socket,
                 death_fd: int | None = None, parent_pid: int | None = None,
                 wakeup_fd: int | None = None):
        super().__init__(core, input_socket, output_socket, death_fd, parent_pid, wakeup_fd)
        self.decoder = msgspec.msgpack.Decoder(SharedInputMessage)
        self._clients: dict[bytes, _Client] = {}
        self._by_tag: dict[str, _Client] = {}
        self._pidfds: dict[int, _Client] = {}
        self._next_tag = 0
        self._ready: bytes | None = None
        self._caller: _Client | None = None
        self._last_liveness = time.monotonic()

    def announce(self, ready: bytes) -> None:
        self._ready = ready  # each Hello is answered with it (they wait in the socket)

    # ---- input ----------------------------------------------------------------------------
    def _drain_input(self) -> None:
        while True:
            try:
                identity, frame = self.input.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            except ValueError:  # not two frames: nobody of ours sends that
                logger.error("dropping a malformed multipart message")
                continue
            try:
                msg = self.decoder.decode(frame.buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                logger.error("dropping a malformed input message: %s", e)
                continue
            client = self._clients.get(identity.bytes)
            if isinstance(msg, Hello):
                if client is None:
                    self._hello(identity.bytes, msg)
                continue
            if client is None:  # (a Detach after its client was found gone: nothing to do)
                if not isinstance(msg, Detach):
                    logger.warning("dropping a %s from an unknown client",
                                   type(msg).__name__)
                continue
            self._from(client, msg)
            if self._stop:
                return

    def _hello(self, identity: bytes, msg: Hello) -> None:
        client = _Client(identity, f"c{self._next_tag}", msg.pid, msg.owner,
                         _push_to(self.input.context, msg.output_address))
        self._next_tag += 1
        client.pidfd = _open_pidfd(msg.pid)
        if client.pidfd is not None:
            self.poller.register(client.pidfd, zmq.POLLIN)
            self._pidfds[client.pidfd] = client
        self._clients[identity] = client
        self._by_tag[client.tag] = client
        logger.info("engine client %s attached (pid %d%s)", client.tag, msg.pid,
                    ", owner" if msg.owner else "")
        if self._ready is not None:
            self._send_to(client, self._ready)

    def _from(self, client: _Client, msg: Any) -> None:
        if isinstance(msg, AddRequest):
            req = msg.request
            req.request_id = client.tag + SEP + req.request_id
            client.live.add(req.request_id)
            self._add(req)
        elif isinstance(msg, AbortRequests):
            ids = [client.tag + SEP + rid for rid in msg.request_ids]
            client.live.difference_update(ids)
            self.core.abort_requests(ids)
        elif isinstance(msg, UtilityCall):
            self._caller = client
            self._send(self._utility(msg))
        elif isinstance(msg, Shutdown) and client.owner:
            self._stop = True
        else:  # Detach, or a Shutdown from a client that does not own the engine
            self._drop(client, "detached")

    def _drop(self, client: _Client, why: str) -> None:
        """Forgets a client; its requests still in the core are aborted."""
        if self._clients.pop(client.identity, None) is None:
            return
        self._by_tag.pop(client.tag, None)
        if client.pidfd is not None:
            self._pidfds.pop(client.pidfd, None)
            self.poller.unregister(client.pidfd)
            os.close(client.pidfd)
        client.out.close(linger=0)
        if client.live:
            self.core.abort_requests(sorted(client.live))
        log = logger.info if why == "detached" else logger.warning
        log("engine client %s (pid %d) %s; %d of its requests aborted", client.tag, client.pid,
            why, len(client.live))
        client.live.clear()

    def _check_fds(self, events: dict[Any, int]) -> None:
        for fd, client in list(self._pidfds.items()):
            if fd in events:
                self._drop(client, "died")
        now = time.monotonic()
        if now - self._last_liveness >= LIVENESS_CHECK_S:  # clients without a pidfd
            self._last_liveness = now
            for client in list(self._clients.values()):
                if client.pidfd is None and not _pid_alive(client.pid):
                    self._drop(client, "died")

    # ---- output ---------------------------------------------------------------------------
    def _send(self, msg: Any) -> None:
        """A utility's result, to the client that called it."""
        if self._caller is not None:
            self._send_to(self._caller, self.encoder.encode(msg))

    def _send_to(self, client: _Client, data: bytes) -> None:
        try:
            client.out.send(data, zmq.NOBLOCK, copy=False)
        except zmq.Again:  # (no high-water mark: only a client that has gone)
            self._drop(client, "is unreachable")

    def _send_outputs(self, result: EngineCoreOutputs) -> None:
        """Each client gets its own outputs (its ids restored) and rejections; the step's
        statistics go to every client, one encoding for those with nothing else."""
        outs: dict[str, list[Any]] = {}
        for out in result.outputs:
            nid = out.request_id
            tag, _, rid = nid.partition(SEP)
            client = self._by_tag.get(tag)
            if client is None:
                continue  # its client has gone
            if out.finish_reason is not None:
                client.live.discard(nid)
            out.request_id = rid
            outs.setdefault(tag, []).append(out)
        rejected: dict[str, dict[str, Rejection]] = {}
        for nid, rejection in self._take_rejected().items():
            tag, _, rid = nid.partition(SEP)
            client = self._by_tag.get(tag)
            if client is not None:
                client.live.discard(nid)
                rejected.setdefault(tag, {})[rid] = rejection
        stats_only: bytes | None = None
        for client in list(self._clients.values()):
            mine, refused = outs.get(client.tag), rejected.get(client.tag)
            if mine is None and refused is None:
                if result.stats is None:
                    continue
                if stats_only is None:
                    stats_only = self.encoder.encode(
                        CoreOutputs(msgspec.structs.replace(result, outputs=[])))
                self._send_to(client, stats_only)
                continue
            self._send_to(client, self.encoder.encode(CoreOutputs(
                msgspec.structs.replace(result, outputs=mine or []), rejected=refused or {})))


def _push_to(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 0)  # never block the step loop on a slow client
    sock.connect(address)
    return sock


def _refuse_hellos(sock: zmq.Socket, message: str, wait_s: float = 0.5) -> None:
    """Start-up failed: every client that has said hello by now gets the reason."""
    decoder = msgspec.msgpack.Decoder(SharedInputMessage)
    failed = msgspec.msgpack.encode(StartupFailed(message))
    while sock.poll(int(wait_s * 1000)):
        try:
            identity, frame = sock.recv_multipart(zmq.NOBLOCK)
            msg = decoder.decode(frame)
        except (zmq.Again, ValueError, msgspec.DecodeError, msgspec.ValidationError):
            continue
        if isinstance(msg, Hello):
            _push_to(sock.context, msg.output_address).send(failed)  # (closed at exit)


def run_shared_engine_core(engine_args: EngineArgs, address: str,
                           death_pipe: Connection | None = None, parent_pid: int | None = None,
                           log_level: int = logging.INFO,
                           build_core: Callable[[EngineArgs], Any] = _build_core) -> None:
    """Entry point of the shared engine process (a `multiprocessing` spawn target); signals
    and exit as run_engine_core."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s [engine] %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)  # receives only: outputs go on each client's own socket
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(address)
    code = 0
    try:
        t0 = time.perf_counter()
        try:
            core = build_core(engine_args)
        except Exception as e:
            logger.exception("engine core failed to start")
            _refuse_hellos(sock, f"{type(e).__name__}: {e}")
            code = 1
        else:
            logger.info("engine core built in %.1f s", time.perf_counter() - t0)
            ready = msgspec.msgpack.encode(Ready(core.limits, pid=os.getpid()))
            try:
                _serve(core, sock, sock, death_pipe, parent_pid, ready,
                       proc_class=SharedCoreProc)
            except Exception:
                logger.exception("the engine core loop failed; the engine exits")
                code = 1
    finally:
        # Every socket, the clients' too; a last message (a startup error) still goes out.
        ctx.destroy(linger=2000)
    _exit_at_once(code)
