"""Publishing the engine's KV cache events over ZMQ (vLLM's kv_events publisher).

After each step that changed the prefix cache, the step's events (kv_cache/events.py) go out
on a PUB socket as one message `[topic, seq (8-byte big-endian), msgpack KVEventBatch]`, seq
counting from 0. A subscriber that sees a gap in seq asks the replay socket (ROUTER) for
every batch since the one it missed: it sends `[b"", seq (8 bytes)]` from a DEALER socket
and gets `[b"", seq, payload]` per batch still buffered (the last buffer_steps), then
`[b"", -1 (8 bytes, signed), b""]`.

A thread owns both sockets, so replays are answered while the engine is idle and the step
loop pays only an encode and an inproc send."""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from typing import Any

import zmq

from shoal.engine.kv_events_args import KVEventsConfig
from shoal.kv_cache.events import EventSink, encode_batch, new_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = b"stop"


def offset_endpoint(endpoint: str, rank: int) -> str:
    """A data-parallel replica's endpoint: the port plus its rank (tcp only)."""
    if not rank or not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + rank}"


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, dp_rank: int = 0):
        self.config = config
        self.dp_rank = dp_rank
        self._ctx = zmq.Context()
        self._topic = config.topic.encode()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay: zmq.Socket | None = None
        addr = f"inproc://shoal-kv-events-{id(self)}"
        self._inbox = self._ctx.socket(zmq.PULL)  # the thread's end
        self._inbox.bind(addr)
        self._outbox = self._ctx.socket(zmq.PUSH)  # the engine's end
        self._outbox.setsockopt(zmq.SNDHWM, config.max_queue_size)
        self._outbox.connect(addr)
        try:
            self._pub.bind(offset_endpoint(config.endpoint, dp_rank))
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(offset_endpoint(config.replay_endpoint, dp_rank))
        except zmq.ZMQError as e:  # a port in use: say which setting
            self._ctx.destroy(linger=0)
            raise ValueError(f"kv_events_config: cannot bind {config.endpoint!r} / "
                             f"{config.replay_endpoint!r} (data-parallel rank {dp_rank}): "
                             f"{e}") from None
        self.seq = 0  # of the next batch (the thread's; read by tests once idle)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._dropped = 0
        self._thread = threading.Thread(target=self._run, name="shoal-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Any]) -> None:
        """Hands one step's events to the thread (never blocks: a full queue drops them)."""
        payload = encode_batch(new_batch(events, self.dp_rank))
        try:
            self._outbox.send(payload, zmq.NOBLOCK)
        except zmq.Again:
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                logger.warning("KV events queue full: %d batches dropped", self._dropped)

    def shutdown(self) -> None:
        if self._thread.is_alive():
            try:
                self._outbox.send(_STOP)
            except zmq.ZMQError:
                pass
            self._thread.join(timeout=5)
        self._outbox.close(linger=0)

    # ---- the publisher thread --------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._inbox, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._inbox in ready and not self._send_pending():
                    return
                if self._replay is not None and self._replay in ready:
                    self._answer_replay()
        except zmq.ZMQError as e:  # the context went away at exit
            logger.debug("KV events publisher stops: %s", e)
        finally:
            for s in (self._inbox, self._pub, self._replay):
                if s is not None:
                    s.close(linger=0)

    def _send_pending(self) -> bool:
        """Publishes every queued batch; False once asked to stop."""
        while True:
            try:
                payload = self._inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if payload == _STOP:
                return False
            seq = self.seq.to_bytes(8, "big")
            self._pub.send_multipart([self._topic, seq, payload])
            self._buffer.append((self.seq, payload))
            self.seq += 1

    def _answer_replay(self) -> None:
        assert self._replay is not None
        while True:
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("KV events replay: bad request of %d frames", len(frames))
                continue
            client, start = frames[0], int.from_bytes(frames[2], "big")
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart([client, b"", seq.to_bytes(8, "big"),
                                                 payload])
            self._replay.send_multipart([client, b"", END_SEQ, b""])


class KVEvents:
    """The engine's side: the block pool's sink, drained into the publisher after each
    step (EngineCore.step calls publish)."""

    def __init__(self, sink: EventSink, publisher: ZmqEventPublisher | None):
        self.sink = sink
        self.publisher = publisher

    def publish(self) -> None:
        if not self.sink.pending:
            return
        events = self.sink.take()
        if self.publisher is not None:
            self.publisher.publish(events)

    def shutdown(self) -> None:
        if self.publisher is not None:
            self.publisher.shutdown()


def attach_kv_events(core: Any, config: KVEventsConfig | None) -> KVEvents | None:
    """Gives the core's block pool a sink and the core a publisher, when events are on
    (after start-up: the warm-up requests' blocks are not reported)."""
    if config is None:
        return None
    kv = getattr(core.scheduler, "kv", None)
    if kv is None:  # a pooling engine: no KV cache
        return None
    rank = core.config.parallel_config.data_parallel_rank or 0
    publisher = ZmqEventPublisher(config, rank) if config.publisher == "zmq" else None
    core.kv_events = KVEvents(EventSink(kv.block_size), publisher)
    kv.pool.events = core.kv_events.sink
    weakref.finalize(core, core.kv_events.shutdown)
    logger.info("KV events on %s (replay: %s)", offset_endpoint(config.endpoint, rank),
                config.replay_endpoint and offset_endpoint(config.replay_endpoint, rank))
    return core.kv_events
