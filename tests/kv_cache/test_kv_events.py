"""KV cache events: the block pool's sink (stored / removed / cleared with the right hashes,
parents and tokens), the ZMQ publisher's sequence numbers and its replay socket, and the
kv_events_config argument."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from shoal.core.request import Request
from shoal.engine.engine_args import EngineArgs
from shoal.engine.kv_events import END_SEQ, ZmqEventPublisher, offset_endpoint
from shoal.engine.kv_events_args import KVEventsConfig
from shoal.kv_cache.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSink,
    KVEventBatch,
    decode_batch,
    encode_batch,
    new_batch,
)
from shoal.kv_cache.hashing import hash_full_blocks
from shoal.kv_cache.manager import KVCacheManager
from shoal.sampling_params import SamplingParams

BS = 4


def make_req(rid: str, prompt: list[int], salt: str | None = None) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=16), frozenset(), 16,
                   cache_salt=salt)


def run_prefill(kv: KVCacheManager, req: Request) -> None:
    hits, n_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - n_hit, hits) is not None
    req.num_computed_tokens = req.num_tokens


def manager(num_blocks: int = 8) -> tuple[KVCacheManager, EventSink]:
    kv = KVCacheManager(num_blocks, BS)
    kv.pool.events = EventSink(BS)
    return kv, kv.pool.events


def test_store_reports_hashes_parent_and_tokens() -> None:
    kv, sink = manager()
    prompt = list(range(10))  # two full blocks and a partial one
    run_prefill(kv, make_req("a", prompt))
    (ev,) = sink.take()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == hash_full_blocks(prompt, BS, [])  # what a router computes
    assert ev.parent_block_hash is None and ev.token_ids == prompt[:8]
    assert ev.block_size == BS and sink.take() == []
    # decode fills the third block: one event whose parent is the second block
    req = make_req("b", list(range(100, 111)))
    run_prefill(kv, req)
    first = sink.take()[0]
    req.append_output_token(7)
    assert kv.allocate_slots(req, 1) is not None
    (ev,) = sink.take()
    assert ev.parent_block_hash == first.block_hashes[-1]
    assert ev.token_ids == [108, 109, 110, 7]
    assert ev.block_hashes == hash_full_blocks(req.all_token_ids, BS, [])[2:]


def test_a_prefix_hit_stores_only_the_new_blocks_and_salt_changes_hashes() -> None:
    kv, sink = manager()
    a = make_req("a", list(range(8)))
    run_prefill(kv, a)
    sink.take()
    b = make_req("b", list(range(12)) + [99])
    run_prefill(kv, b)
    (ev,) = sink.take()
    assert ev.block_hashes == hash_full_blocks(b.all_token_ids, BS, [])[2:]
    assert ev.parent_block_hash == hash_full_blocks(a.all_token_ids, BS, [])[-1]
    c = make_req("c", list(range(8)), salt="tenant")
    run_prefill(kv, c)
    (ev,) = sink.take()
    assert ev.block_hashes == hash_full_blocks(c.all_token_ids, BS, [], "tenant")
    assert not set(ev.block_hashes) & set(hash_full_blocks(a.all_token_ids, BS, []))


def test_eviction_and_reset_are_reported() -> None:
    kv, sink = manager(num_blocks=4)
    a = make_req("a", list(range(8)))
    run_prefill(kv, a)
    kv.free(a)
    stored = sink.take()[0].block_hashes
    b = make_req("b", list(range(50, 66)))  # four blocks: both of a's cached blocks go
    run_prefill(kv, b)
    events = sink.take()
    assert isinstance(events[0], BlockRemoved)
    assert sorted(events[0].block_hashes) == sorted(stored)
    assert isinstance(events[1], BlockStored) and len(events[1].block_hashes) == 4
    kv.free(b)
    assert kv.reset_prefix_cache()
    assert sink.take() == [AllBlocksCleared()]


def test_no_sink_no_events_and_batches_round_trip() -> None:
    kv = KVCacheManager(8, BS)
    run_prefill(kv, make_req("a", list(range(8))))
    assert kv.pool.events is None
    batch = new_batch([BlockStored([b"x" * 16], None, [1, 2], 2), BlockRemoved([b"y" * 16]),
                       AllBlocksCleared()], dp_rank=1)
    assert decode_batch(encode_batch(batch)) == batch
    # array-like and tagged as vLLM's: ["BlockStored", hashes, parent, tokens, size, ...]
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert raw[1][0][0] == "BlockStored" and raw[1][2] == ["AllBlocksCleared"]


def test_kv_events_config_validation() -> None:
    assert EngineArgs().kv_events_settings() is None
    assert EngineArgs(kv_events_config={"enable_kv_cache_events": False}
                      ).kv_events_settings() is None
    on = EngineArgs(kv_events_config='{"enable_kv_cache_events": true, "topic": "kv"}')
    assert on.kv_events_settings() == KVEventsConfig(True, topic="kv")
    for bad, field in [({"bogus": 1}, "bogus"), ({"publisher": "kafka"}, "publisher"),
                       ({"buffer_steps": 0}, "buffer_steps"), ({"endpoint": 5}, "endpoint"),
                       ({"enable_kv_cache_events": "yes"}, "enable_kv_cache_events")]:
        with pytest.raises(ValueError, match=field):
            KVEventsConfig.from_dict(bad)
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 2) == "ipc:///tmp/kv"


def _recv(sock: zmq.Socket, timeout_ms: int = 5000) -> list[bytes]:
    assert sock.poll(timeout_ms), "nothing received"
    return sock.recv_multipart()


def test_publisher_sequence_numbers_and_replay() -> None:
    ctx = zmq.Context.instance()
    # ephemeral ports: bind "*" and read them back
    pub = ZmqEventPublisher(KVEventsConfig(True, endpoint="tcp://127.0.0.1:*",
                                           replay_endpoint="tcp://127.0.0.1:*",
                                           buffer_steps=3, topic="kv"))
    endpoint = pub._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
    replay_ep = pub._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(endpoint)
    time.sleep(0.3)  # the subscription reaches the publisher (ZMQ's slow joiner)
    try:
        for i in range(5):
            pub.publish([BlockRemoved([bytes([i]) * 16])])
        got = [_recv(sub) for _ in range(5)]
        assert [int.from_bytes(f[1], "big") for f in got] == [0, 1, 2, 3, 4]
        assert all(f[0] == b"kv" for f in got)
        assert decode_batch(got[3][2]).events == [BlockRemoved([b"\x03" * 16])]
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(replay_ep)
        dealer.send_multipart([b"", (3).to_bytes(8, "big")])
        replies = [_recv(dealer) for _ in range(3)]
        assert [int.from_bytes(r[1], "big") for r in replies[:2]] == [3, 4]
        assert replies[1][2] == got[4][2] and replies[2][1:] == [END_SEQ, b""]
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])  # only the last 3 are kept
        seqs = [int.from_bytes(_recv(dealer)[1], "big", signed=True) for _ in range(4)]
        assert seqs == [2, 3, 4, -1]
        dealer.close(linger=0)
        assert isinstance(decode_batch(got[0][2]), KVEventBatch)
    finally:
        sub.close(linger=0)
        pub.shutdown()


# ---- the router's side: index, choice, and a subscriber that replays what it missed ------
def test_index_matches_leading_blocks_and_router_balances() -> None:
    from shoal.router.index import PrefixIndex
    from shoal.router.policy import Backend, Router, Target

    h = hash_full_blocks(list(range(16)), BS, [])
    index = PrefixIndex()
    index.apply(0, [BlockStored(h[:3], None, [], BS)])
    index.apply(1, [BlockStored(h[:1], None, [], BS), BlockStored(h[2:], h[1], [], BS)])
    assert index.match(h) == {0: 3, 1: 1}  # backend 1 lacks block 1: its hit stops there
    index.apply(0, [BlockRemoved([h[0]])])
    assert index.match(h) == {1: 1}
    index.apply(1, [AllBlocksCleared()])
    assert index.match(h) == {} and index.num_blocks(1) == 0
    router = Router([Backend("http://a"), Backend("http://b")], block_size=BS,
                    max_imbalance=2)
    router.index.apply((1, 0), [BlockStored(h[:2], None, [], BS)])  # (backend, replica)
    assert router.choose(h) == Target(1, 0, hit=2)
    router.backends[1].replicas[0].in_flight = 3  # too busy beside an idle one: balance
    assert router.choose(h) == Target(0, 0, hit=0)
    router.backends[1].replicas[0].in_flight = 0
    picks = [router.choose([]).backend for _ in range(4)]  # round robin among equals
    assert picks[0] != picks[1] and picks[:2] == picks[2:]


def test_subscriber_replays_batches_it_missed() -> None:
    import asyncio

    import zmq.asyncio

    from shoal.router.subscriber import EventSubscriber

    pub = ZmqEventPublisher(KVEventsConfig(True, endpoint="tcp://127.0.0.1:*",
                                           replay_endpoint="tcp://127.0.0.1:*"))
    endpoint = pub._pub.getsockopt(zmq.LAST_ENDPOINT).decode()
    replay_ep = pub._replay.getsockopt(zmq.LAST_ENDPOINT).decode()
    for i in range(3):  # before anyone listens: lost to PUB/SUB, kept for replay
        pub.publish([BlockRemoved([bytes([i]) * 16])])
    # publish() hands batches to the publisher's thread: wait until it has sent them, or a
    # subscriber connecting first would hear them live and need no replay (1 run in 5 here)
    for _ in range(500):
        if pub.seq == 3:
            break
        time.sleep(0.01)
    assert pub.seq == 3
    got: list[bytes] = []

    async def follow() -> None:
        ctx = zmq.asyncio.Context()
        sub = EventSubscriber(ctx, endpoint, replay_ep,
                              lambda b: got.extend(e.block_hashes[0] for e in b.events),
                              got.clear)
        task = asyncio.create_task(sub.run())
        # A SUB socket joins some time after connect (a slow joiner on a busy machine):
        # publish until it hears one; whatever it missed comes back through one replay.
        sent = 3
        for _ in range(100):
            if got:
                break
            pub.publish([BlockRemoved([bytes([sent]) * 16])])
            sent += 1
            await asyncio.sleep(0.1)
        for _ in range(100):
            if len(got) == sent:
                break
            await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        ctx.destroy(linger=0)
        assert sub.replays == 1 and sub.last_seq == sent - 1
        return sent

    try:
        sent = asyncio.run(follow())
    finally:
        pub.shutdown()
    assert sent > 3 and got == [bytes([i]) * 16 for i in range(sent)]
