"""The engine-core process: EngineCore behind two ZMQ sockets, msgpack messages, no pickle
(the messages are shoal/engine/core_messages.py).

    frontend --PUSH--> input socket  --PULL--> engine   add / abort / utility / shutdown
    frontend <--PULL-- output socket <--PUSH-- engine   ready / startup error / outputs / results

The loop drains every input message, steps while there is work and otherwise blocks on the
socket (and the death pipe), so an idle engine burns no CPU. A request the core rejects
produces a `rejected` entry for that request only; the loop never dies of bad input.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from shoal.core.errors import ErrorCode
from shoal.core.types import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from shoal.engine import step_trace
from shoal.engine.core_messages import (
    AbortRequests,
    AddRequest,
    CoreOutputs,
    InputMessage,
    Ready,
    Rejection,
    Shutdown,
    StartupFailed,
    UtilityCall,
    UtilityResult,
)
from shoal.engine.engine_args import EngineArgs
from shoal.lora_request import LoRARequest

logger = logging.getLogger(__name__)

# While idle, wake up this often to check that the parent is still there (belt and braces next
# to the death pipe, which covers the normal case at once).
IDLE_POLL_MS = 2000
# A step that scheduled nothing while requests are unfinished (all waiting on something outside
# the step: a remote KV fetch, a KV load from a slower tier) makes the next poll wait this long
# for input instead of stepping again at once: a loop of empty steps holds the interpreter
# lock the fetch threads need (a disaggregated decode engine's fetches ran at about half
# speed beside it) and sends a stats message each time.
EMPTY_STEP_POLL_MS = 1


class EngineCoreProc:
    """The busy loop around one EngineCore (anything with its methods, for tests)."""

    UTILITIES = ("ping", "get_stats", "reset_stats", "add_lora", "remove_lora", "pin_lora",
                 "list_loras", "sleep", "wake_up", "is_sleeping", "reset_prefix_cache", "pause_generation", "resume_generation",
                 "is_paused", "pause_settled", "collective_rpc")

    def __init__(self, core: Any, input_socket: zmq.Socket, output_socket: zmq.Socket,
                 death_fd: int | None = None, parent_pid: int | None = None,
                 wakeup_fd: int | None = None):
        self.core = core
        self.input = input_socket
        self.output = output_socket
        self.death_fd = death_fd
        self.parent_pid = parent_pid
        self.wakeup_fd = wakeup_fd  # readable when a signal arrived (signal.set_wakeup_fd)
        self.decoder = msgspec.msgpack.Decoder(InputMessage)
        self.encoder = msgspec.msgpack.Encoder()
        self._stop = False
        self._rejected: dict[str, Rejection] = {}  # sent with the next outputs
        self._last_stats = SchedulerStats()
        self._baseline = SchedulerStats()  # cumulative counters at the last reset_stats
        self.trace = step_trace.StepTrace.from_env()  # SHOAL_STEP_TRACE: per-step timings
        self._added = 0  # requests added since the last traced step
        self._last_step_empty = False  # it scheduled no token and produced no output

    # ---- loop -----------------------------------------------------------------------------
    def run(self) -> None:
        poller = self.poller = zmq.Poller()  # (a subclass registers more fds)
        poller.register(self.input, zmq.POLLIN)
        for fd in (self.death_fd, self.wakeup_fd):
            if fd is not None:
                poller.register(fd, zmq.POLLIN)
        # DP+EP (engine/dp_lockstep.py): every step is a round with the other replicas, and an
        # idle engine keeps joining them every few milliseconds.
        lockstep = getattr(self.core, "dp_lockstep", None)
        idle_ms = IDLE_POLL_MS if lockstep is None else lockstep.idle_poll_ms
        while not self._stop:
            busy = self.core.has_unfinished_requests()
            wait = (EMPTY_STEP_POLL_MS if self._last_step_empty and lockstep is None else 0)
            events = dict(poller.poll(wait if busy else idle_ms))
            if self._parent_gone(events):
                logger.warning("the frontend process is gone; the engine core exits")
                return
            self._check_fds(events)
            if self.wakeup_fd is not None and self.wakeup_fd in events:
                _drain_fd(self.wakeup_fd)  # the handler has set the flag (request_stop)
                continue
            t0 = step_trace.now() if self.trace is not None else 0.0
            if self.input in events:
                self._drain_input()
            if self._rejected and not self.core.has_unfinished_requests():
                self._send_outputs(EngineCoreOutputs())
            if not self._stop and (lockstep is not None
                                   or self.core.has_unfinished_requests()):
                try:
                    if self.trace is not None:
                        self._traced_step(t0)
                    else:
                        self._step()
                except Exception as e:
                    if self._stopping_anyway(e):
                        return
                    raise
        if self.trace is not None:
            self.trace.close()

    def _parent_gone(self, events: dict[Any, int]) -> bool:
        if self.death_fd is not None and self.death_fd in events:
            return True  # the write end closed: the parent exited
        return self.parent_pid is not None and os.getppid() != self.parent_pid

    def _check_fds(self, events: dict[Any, int]) -> None:
        """Other fds registered on `self.poller` (the shared engine's client pidfds)."""

    def _drain_input(self) -> None:
        while True:
            try:
                frame = self.input.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = self.decoder.decode(frame.buffer)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                # Nothing to answer: without a valid message there is no request id.
                logger.error("dropping a malformed input message: %s", e)
                continue
            self._handle(msg)
            if self._stop:
                return

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, AddRequest):
            self._add(msg.request)
        elif isinstance(msg, AbortRequests):
            self.core.abort_requests(msg.request_ids)
        elif isinstance(msg, UtilityCall):
            self._send(self._utility(msg))
        elif isinstance(msg, Shutdown):
            self._stop = True

    def _add(self, req: EngineCoreRequest) -> None:
        try:
            self.core.add_request(req)
        except ValueError as e:  # a bad request that slipped past the frontend: reject only it
            logger.warning("rejected request %s: %s", req.request_id, e)
            self._rejected[req.request_id] = Rejection(str(e) or type(e).__name__)
            return
        except Exception as e:  # the core's own failure: still only this request's
            logger.exception("adding request %s failed", req.request_id)
            self._rejected[req.request_id] = Rejection(
                f"the engine failed to add this request: {type(e).__name__}: {e}",
                ErrorCode.ENGINE_FAILED)
            return
        self._added += 1

    def _stopping_anyway(self, error: Exception) -> bool:
        """DP+EP: another replica left the group; when it was told to shut down, so is this
        one (its Shutdown may be a moment behind): wait a little for it, then exit quietly."""
        if type(error).__name__ != "DPPeerLostError":
            return False
        deadline = time.monotonic() + 1.0
        while not self._stop and time.monotonic() < deadline:
            if self.input.poll(100):
                self._drain_input()
        return self._stop

    def _step(self) -> None:
        result = self.core.step()
        self._last_step_empty = _did_nothing(self.core, result)
        if not result.outputs and result.stats is None and not self._rejected:
            return  # an idle DP+EP round: nothing happened
        if result.stats is not None:
            self._last_stats = result.stats
            result.stats = self._rebased(result.stats)
        self._send_outputs(result)

    def _traced_step(self, t0: float) -> None:
        """_step, timed into the step trace (SHOAL_STEP_TRACE)."""
        assert self.trace is not None
        t1 = step_trace.now()
        result = self.core.step()
        self._last_step_empty = _did_nothing(self.core, result)
        if not result.outputs and result.stats is None and not self._rejected:
            return  # an idle DP+EP round
        t2 = step_trace.now()
        stats = result.stats
        if stats is not None:
            self._last_stats = stats
            result.stats = self._rebased(stats)
        self._send_outputs(result)
        t3 = step_trace.now()
        self.trace.record(step_trace.StepRecord(
            t=t0, drain_ms=(t1 - t0) * 1e3, step_ms=(t2 - t1) * 1e3, send_ms=(t3 - t2) * 1e3,
            added=self._added, tokens=(stats.num_prompt_tokens + stats.num_generation_tokens
                                       if stats is not None else 0),
            running=stats.num_running if stats is not None else 0,
            waiting=stats.num_waiting if stats is not None else 0))
        self._added = 0

    def announce(self, ready: bytes) -> None:
        """The ready message, to the frontend (the shared engine answers each client's hello
        with it instead)."""
        self.output.send(ready)

    def request_stop(self, *_: Any) -> None:
        """SIGTERM: stop between steps, never inside one (a step cut short could leave KV
        copies half done that shutdown would then persist)."""
        self._stop = True

    def _send_outputs(self, result: EngineCoreOutputs) -> None:
        """A step's outputs and the rejections since the last ones (engine/shared_core.py
        splits them between its clients)."""
        self._send(CoreOutputs(result, rejected=self._take_rejected()))

    def _take_rejected(self) -> dict[str, Rejection]:
        rejected, self._rejected = self._rejected, {}
        return rejected

    # ---- utilities ------------------------------------------------------------------------
    def _utility(self, call: UtilityCall) -> UtilityResult:
        handlers: dict[str, Callable[..., Any]] = {
            "ping": lambda: "pong",
            "get_stats": lambda: msgspec.to_builtins(self._rebased(self._last_stats)),
            "reset_stats": self._reset_stats,
            "add_lora": lambda lora: self.core.add_lora(lora_request_of(lora)),
            "remove_lora": lambda lora_id: self.core.remove_lora(int(lora_id)),
            "pin_lora": lambda lora_id: self.core.pin_lora(int(lora_id)),
            "list_loras": lambda: sorted(self.core.list_loras()),
            "sleep": lambda level: self.core.sleep(int(level)),
            "wake_up": lambda tags=None: self.core.wake_up(tags),
            "is_sleeping": lambda: bool(self.core.sleep_level),
            "reset_prefix_cache": lambda: self.core.reset_prefix_cache(),
            # engine/pause.py; the frontend polls pause_settled to wait for the drain
            "pause_generation": lambda wait=False, clear=True: self.core.pause_generation(
                bool(wait), bool(clear)),
            "resume_generation": lambda: self.core.resume_generation(),
            "is_paused": lambda: self.core.pause.paused,
            "pause_settled": lambda: self.core.pause.settled(self.core),
            "collective_rpc": lambda method, args=None, kwargs=None: self.core.collective_rpc(
                str(method), rpc_arguments(str(method), args, kwargs)),
        }
        handler = handlers.get(call.method)
        if handler is None:
            return UtilityResult(call.call_id, error=f"unknown utility {call.method!r}")
        try:
            return UtilityResult(call.call_id, handler(*call.args))
        except Exception as e:
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")

    def _reset_stats(self) -> bool:
        s = self._last_stats
        self._baseline = SchedulerStats(prefix_cache_queries=s.prefix_cache_queries,
                                        prefix_cache_hits=s.prefix_cache_hits,
                                        num_preemptions=s.num_preemptions)
        return True

    def _rebased(self, s: SchedulerStats) -> SchedulerStats:
        """Cumulative counters relative to the last reset_stats."""
        b = self._baseline
        return msgspec.structs.replace(
            s, prefix_cache_queries=s.prefix_cache_queries - b.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits - b.prefix_cache_hits,
            num_preemptions=s.num_preemptions - b.num_preemptions)

    def _send(self, msg: Any) -> None:
        self.output.send(self.encoder.encode(msg), copy=False)


def lora_request_of(raw: Any) -> LoRARequest:
    """add_lora's argument as it crossed the socket (a LoRARequest encodes as a map)."""
    try:
        return msgspec.convert(raw, LoRARequest)
    except msgspec.ValidationError as e:
        raise ValueError(f"add_lora: not a LoRARequest ({e})") from None


def rpc_arguments(method: str, args: list[Any] | None, kwargs: dict[str, Any] | None
                  ) -> list[Any]:
    """A lifecycle method's arguments checked against its signature (a bad one is the
    caller's ValueError, naming the method), keyword ones made positional."""
    import inspect

    from shoal.worker.lifecycle import RPC_METHODS, RunnerLifecycle

    if method not in RPC_METHODS:
        raise ValueError(f"collective_rpc: unknown method {method!r} (one of "
                         f"{', '.join(sorted(RPC_METHODS))})")
    try:  # (the engine's own sleep and wake_up take the ranks' parameters)
        bound = inspect.signature(getattr(RunnerLifecycle, method)).bind(
            None, *(args or ()), **(kwargs or {}))
    except TypeError as e:
        raise ValueError(f"collective_rpc: bad arguments for {method!r}: {e}") from None
    bound.apply_defaults()
    return list(bound.args[1:])


def _build_core(engine_args: EngineArgs) -> Any:
    """The model-loading EngineCore of a server (imported here: the frontend imports this
    module and must not load torch)."""
    from shoal.engine.startup import start_engine_core

    return start_engine_core(engine_args, serving=True).core


def _drain_fd(fd: int) -> None:
    try:
        while os.read(fd, 512):
            pass
    except (BlockingIOError, InterruptedError):
        pass


def _did_nothing(core: Any, result: EngineCoreOutputs) -> bool:
    """A step that launched nothing, had nothing in flight and produced no output."""
    return not result.outputs and bool(getattr(core, "last_step_idle", False))


def run_engine_core(engine_args: EngineArgs, input_addr: str, output_addr: str,
                    death_pipe: Connection | None = None, parent_pid: int | None = None,
                    log_level: int = logging.INFO,
                    build_core: Callable[[EngineArgs], Any] = _build_core) -> None:
    """Entry point of the engine process (a `multiprocessing` spawn target)."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(asctime)s [engine] %(message)s")
    # Ctrl-C reaches the whole process group; the frontend decides when the engine stops (it
    # drains requests first), so the engine ignores SIGINT and exits on Shutdown or SIGTERM.
    # Before the loop runs there is nothing to protect: SIGTERM exits at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctx = zmq.Context()
    out_sock = ctx.socket(zmq.PUSH)
    # No high-water mark: a frontend that falls behind for a moment must never block the
    # engine's step loop (outputs are small; the frontend drains them as it catches up).
    out_sock.setsockopt(zmq.SNDHWM, 0)
    out_sock.connect(output_addr)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.connect(input_addr)
    encoder = msgspec.msgpack.Encoder()
    code = 0
    try:
        t0 = time.perf_counter()
        try:
            core = build_core(engine_args)
        except Exception as e:
            logger.exception("engine core failed to start")
            out_sock.send(encoder.encode(StartupFailed(f"{type(e).__name__}: {e}")))
            code = 1
        else:
            logger.info("engine core built in %.1f s", time.perf_counter() - t0)
            ready = encoder.encode(Ready(core.limits, pid=os.getpid()))
            try:
                _serve(core, in_sock, out_sock, death_pipe, parent_pid, ready)
            except Exception:  # DP+EP: a replica lost (a step error is fatal there)
                logger.exception("the engine core loop failed; the engine exits")
                code = 1
    finally:
        # Linger so a last message (the startup error above all) still reaches the frontend.
        out_sock.close(linger=2000)
        in_sock.close(linger=0)
        ctx.term()
    _exit_at_once(code)


def _exit_at_once(code: int) -> None:
    """Ends the process without tearing the interpreter down: unloading torch and the model
    took ~2.7 s of an idle server's exit. What must outlive the process was written by the
    core's shutdown already; logs and stdio are flushed here, and the ranks of an mp executor
    never shut down (a failed start or shutdown) leave their process group first."""
    multiproc = sys.modules.get("shoal.executor.multiproc")  # loaded only where ranks ran
    if multiproc is not None:
        try:
            multiproc.release_all()
        except Exception:
            logger.exception("releasing the executor's ranks at exit failed")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve(core: Any, in_sock: zmq.Socket, out_sock: zmq.Socket,
           death_pipe: Connection | None, parent_pid: int | None, ready: bytes,
           proc_class: type[EngineCoreProc] = EngineCoreProc) -> None:
    """Reports ready, runs the loop, then the core's shutdown. From before the ready message
    on, SIGTERM only sets the loop's stop flag (a self-pipe wakes the idle poll at once, and
    the step running finishes first), so a frontend that stops the engine as soon as it is
    ready still gets the shutdown."""
    death_fd = death_pipe.fileno() if death_pipe is not None else None
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    proc = proc_class(core, in_sock, out_sock, death_fd, parent_pid, wakeup_fd=wake_r.fileno())
    old_fd = signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGTERM, proc.request_stop)
    try:
        proc.announce(ready)
        logger.info("engine core process %d ready (%d KV blocks)", os.getpid(),
                    core.limits.num_kv_blocks)
        proc.run()
    finally:
        try:
            core.shutdown()
        except Exception:
            logger.exception("engine core shutdown failed")
        signal.set_wakeup_fd(old_fd)
        wake_r.close()
        wake_w.close()
