"""Following one backend's KV events: a SUB socket, and the replay socket for the batches a
gap in the sequence numbers says were missed (a late subscription, a full queue)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import zmq
import zmq.asyncio

from shoal.kv_cache.events import KVEventBatch, decode_batch

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 2.0
END_SEQ = -1


class EventSubscriber:
    """Calls `apply(batch)` for each batch of one endpoint in sequence order, once each;
    `reset()` when the publisher restarted (its sequence began again at 0)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, replay_endpoint: str | None,
                 apply: Callable[[KVEventBatch], None], reset: Callable[[], None],
                 topic: str = ""):
        self.ctx, self.endpoint, self.replay_endpoint = ctx, endpoint, replay_endpoint
        self.apply, self.reset = apply, reset
        self.topic = topic.encode()
        self.last_seq: int | None = None
        self.replays = 0

    async def run(self) -> None:
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(self.endpoint)
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    logger.warning("KV events from %s: %d frames, expected 3", self.endpoint,
                                   len(frames))
                    continue
                await self._on_message(int.from_bytes(frames[1], "big"), frames[2])
        finally:
            sub.close(linger=0)

    async def _on_message(self, seq: int, payload: bytes) -> None:
        last = self.last_seq
        if last is not None and seq == 0 and last > 0:  # the backend restarted
            logger.info("KV events from %s start again at 0: forgetting its blocks",
                        self.endpoint)
            self.reset()
            last = self.last_seq = None
        if last is not None and seq <= last:
            return  # already applied through a replay
        expected = 0 if last is None else last + 1
        if seq > expected and self.replay_endpoint:
            await self._replay(expected)
        elif seq > expected and last is not None:
            logger.warning("KV events from %s: batches %d-%d lost (no replay endpoint)",
                           self.endpoint, expected, seq - 1)
        if self.last_seq is None or seq > self.last_seq:
            self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            self.apply(decode_batch(payload))
        except Exception:  # a bad batch must not stop the router following the backend
            logger.exception("bad KV events batch %d from %s", seq, self.endpoint)
        self.last_seq = seq

    async def _replay(self, start: int) -> None:
        """Applies every batch from `start` the backend still buffers."""
        assert self.replay_endpoint is not None
        self.replays += 1
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(sock.recv_multipart(), REPLAY_TIMEOUT_S)
                seq = int.from_bytes(frames[1], "big", signed=True)
                if seq == END_SEQ:
                    return
                if self.last_seq is None or seq > self.last_seq:
                    self._apply(seq, frames[2])
        except TimeoutError:
            logger.warning("KV events replay from %s timed out", self.replay_endpoint)
        finally:
            sock.close(linger=0)
