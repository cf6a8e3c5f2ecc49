"""A decode engine (kv_consumer) keeps stepping its other requests while one request's KV is
on its way: the fetch runs on a background thread and the request waits unadmitted. The KV
goes through a relay that holds the producer's reply back and trickles it out over more
than a second; meanwhile a request already decoding keeps producing tokens with small gaps
(a fetch inside the step would leave one gap as long as the transfer), and the transferred
request's greedy tokens equal one engine's."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from engine_helpers import tiny_llm
from oracle import write_tiny_checkpoint

from shoal import SamplingParams
from shoal.engine.output_processor import OutputKind

PROMPT_A = [(5 * j) % 500 + 1 for j in range(20)]
PROMPT_B = [(11 * j + 7) % 500 + 1 for j in range(200)]
TRICKLE_S = 1.5


class SlowRelay:
    """A TCP relay to the producer's KV server: the request goes through at once; the reply is
    read whole, then sent on in 30 pieces over about TRICKLE_S seconds."""

    def __init__(self, port: int):
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.window: tuple[float, float] | None = None  # (first piece sent, last piece sent)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        with client, socket.create_connection(("127.0.0.1", self.target)) as up:
            up.sendall(client.recv(1 << 16))  # the request header (a few dozen bytes)
            reply = bytearray()
            while chunk := up.recv(1 << 20):
                reply += chunk
            n = -(-len(reply) // 30)
            start = time.monotonic()
            for i in range(0, len(reply), n):
                if i:
                    time.sleep(TRICKLE_S / 30)
                if i + n >= len(reply):  # (the consumer may finish as soon as it is sent)
                    self.window = (start, time.monotonic())
                client.sendall(reply[i:i + n])

    def close(self) -> None:
        self.listener.close()


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def long_llama_dir(tmp_path_factory):
    """The tiny Llama with room for a request that decodes all through the transfer."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("long-llama"), "llama",
                                 max_position_embeddings=4096)


def test_other_requests_keep_decoding_while_a_kv_fetch_is_in_flight(long_llama_dir) -> None:
    one = tiny_llm(long_llama_dir)
    want = list(one.generate({"prompt_token_ids": PROMPT_B}, _greedy(8),
                             use_tqdm=False)[0].outputs[0].token_ids)
    one.shutdown()
    producer = tiny_llm(long_llama_dir, kv_transfer_config={
        "kv_connector": "P2PConnector", "kv_role": "kv_producer", "kv_port": 0})
    # the bytes over TCP through the relay (not out of the producer's /dev/shm file)
    consumer = tiny_llm(long_llama_dir, block_size=8, max_model_len=4096, kv_transfer_config={
        "kv_connector": "P2PConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"kv_shared_memory": False}})
    relay = None
    try:
        (pre,) = producer.generate({"prompt_token_ids": PROMPT_B}, SamplingParams(
            temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
            use_tqdm=False)
        params = pre.kv_transfer_params
        relay = SlowRelay(params["remote_port"])
        eng = consumer.llm_engine
        eng.add_request("a", {"prompt_token_ids": PROMPT_A}, _greedy(4000),
                        kind=OutputKind.DELTA)
        a_times: list[float] = []
        while len(a_times) < 3:  # a is decoding
            a_times += [time.monotonic() for o in eng.step() if o.request_id == "a"]
        eng.add_request("b", {"prompt_token_ids": PROMPT_B},
                        _greedy(8, kv_transfer_params={**params,
                                                       "remote_port": relay.port}))
        b_out = None
        deadline = time.monotonic() + 60
        while b_out is None and time.monotonic() < deadline:
            for o in eng.step():
                if o.request_id == "a" and o.outputs[0].token_ids:
                    a_times.append(time.monotonic())
                elif o.request_id == "b" and o.finished:
                    b_out = o
        assert b_out is not None, "the transferred request never finished"
        assert relay.window is not None
        start, end = relay.window
        assert end - start >= TRICKLE_S * 0.8
        during = [t for t in a_times if start <= t <= end]
        # a kept producing tokens all through the transfer (and after it), with no long gap
        assert len(during) >= 5 and a_times[-1] > end, (len(during), end - start)
        gaps = [b - a for a, b in zip(a_times, a_times[1:]) if b >= start and a <= end]
        assert max(gaps) < 0.5 * (end - start), max(gaps)
        assert list(b_out.outputs[0].token_ids) == want
        assert b_out.num_cached_tokens == len(PROMPT_B) - 1  # loaded, not computed
        assert eng.core.kv_connector.num_loaded == 1
        eng.abort_request("a")
    finally:
        if relay is not None:
            relay.close()
        producer.shutdown()
        consumer.shutdown()
