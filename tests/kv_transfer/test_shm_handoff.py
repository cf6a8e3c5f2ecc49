"""The same-host path of a KV fetch (kv_transfer/shm_buffers.py, transport.py): the consumer
copies the bytes out of the producer's /dev/shm file instead of receiving them over TCP; the
decode engine then gives one engine's tokens; a file it cannot read sends the bytes over the
socket instead, a producer that is gone still means a recompute."""

from __future__ import annotations

import numpy as np
import pytest
from engine_helpers import tiny_llm

from shoal import SamplingParams
from shoal.kv_transfer import transport
from shoal.kv_transfer.payload import HostBufferPool
from shoal.kv_transfer.shm_buffers import (
    SHM_DIR,
    SharedPlace,
    is_loopback,
    locate,
    read_shared,
)
from shoal.kv_transfer.transport import KVServer, Reply, fetch

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")

PROMPTS = [[(5 * i + 7 * j) % 400 + 1 for j in range(33 + 6 * i)] for i in range(2)]
STEPS = 6


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    llm = tiny_llm(tiny_llama_dir)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _greedy(), use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture
def reads(monkeypatch):
    """The consumer's reads of shared files (each call's place), as they happen."""
    seen: list[SharedPlace] = []

    def spy(place, into, *a):
        seen.append(place)
        return read_shared(place, into, *a)

    monkeypatch.setattr(transport, "read_shared", spy)
    return seen


def _engines(path, consumer_extra=None):
    producer = tiny_llm(path, block_size=4, kv_transfer_config={
        "kv_connector": "P2PConnector", "kv_role": "kv_producer", "kv_port": 0})
    consumer = tiny_llm(path, block_size=8, kv_transfer_config={
        "kv_connector": "P2PConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": consumer_extra or {}})
    return producer, consumer


def _decode(producer, consumer, prompts):
    params = []
    for p in prompts:
        (out,) = producer.generate({"prompt_token_ids": p}, SamplingParams(
            temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
            use_tqdm=False)
        params.append(out.kv_transfer_params)
    outs = consumer.generate([{"prompt_token_ids": p} for p in prompts],
                             [_greedy(kv_transfer_params=kp) for kp in params], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], params


@pytest.mark.parametrize("shared", [True, False], ids=["shm", "tcp"])
def test_decode_engine_gives_one_engines_tokens_through_shared_files(
        tiny_llama_dir, reference, reads, shared) -> None:
    producer, consumer = _engines(tiny_llama_dir, {"kv_shared_memory": shared})
    try:
        tokens, _ = _decode(producer, consumer, PROMPTS)
        connector = consumer.llm_engine.core.kv_connector
        assert connector.num_loaded == len(PROMPTS) and connector.num_failed == 0
        assert tokens == reference
        assert len(reads) == (len(PROMPTS) if shared else 0)
        assert all(r.path.startswith(str(SHM_DIR / "shoal-kv-")) for r in reads)
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_an_unreadable_shared_file_sends_the_bytes_over_tcp(tiny_llama_dir, reference,
                                                            monkeypatch) -> None:
    def unreadable(place, into, *a):
        raise OSError("another host's /dev/shm")

    monkeypatch.setattr(transport, "read_shared", unreadable)
    producer, consumer = _engines(tiny_llama_dir)
    try:
        tokens, _ = _decode(producer, consumer, PROMPTS[:1])
        connector = consumer.llm_engine.core.kv_connector
        assert connector.num_loaded == 1 and connector.num_failed == 0
        assert tokens == reference[:1]
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_a_producer_gone_still_means_a_recompute(tiny_llama_dir, reference, reads) -> None:
    producer, consumer = _engines(tiny_llama_dir)
    try:
        (out,) = producer.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(
            temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
            use_tqdm=False)
        producer.shutdown()
        (got,) = consumer.generate({"prompt_token_ids": PROMPTS[1]},
                                   _greedy(kv_transfer_params=out.kv_transfer_params),
                                   use_tqdm=False)
        connector = consumer.llm_engine.core.kv_connector
        assert connector.num_loaded == 0 and connector.num_failed == 1 and not reads
        assert list(got.outputs[0].token_ids) == reference[1]
    finally:
        producer.shutdown()
        consumer.shutdown()


@pytest.mark.parametrize("where", ["shared", "plain"])
def test_a_body_is_read_from_its_file_or_sent(reads, where) -> None:
    """A body in a shared host buffer is named where it is; one in plain memory (a pinned
    buffer on CUDA) goes on the socket, as to a client that does not ask."""
    pool = HostBufferPool(shared=True)
    want = np.random.default_rng(3).integers(0, 256, (3 << 20) + 5, dtype=np.uint8)
    body = pool.get(len(want)) if where == "shared" else np.empty(len(want), np.uint8)
    np.frombuffer(body, dtype=np.uint8)[:] = want
    if where == "shared":
        assert locate(body) is not None
    else:
        assert locate(body) is None
    server = KVServer("127.0.0.1", 0, lambda req: Reply({"k": 1}, body, None,
                                                        req.get("shared") is True))
    try:
        header, got = fetch("127.0.0.1", server.port, {}, 10.0, shared=True)
        named = where == "shared"
        assert header["nbytes"] == len(want) and ("shared" in header) == named
        assert np.array_equal(np.frombuffer(got, dtype=np.uint8), want)
        assert len(reads) == int(named)
        if named:
            assert reads[0] == locate(body)
        header, got = fetch("127.0.0.1", server.port, {}, 10.0)
        assert "shared" not in header and len(reads) == int(named)
        assert np.array_equal(np.frombuffer(got, dtype=np.uint8), want)
    finally:
        server.close()


def test_only_shoal_kv_files_of_dev_shm_are_read(tmp_path) -> None:
    into = bytearray(4)
    (tmp_path / "shoal-kv-x").write_bytes(b"abcd")
    (tmp_path / "shoal-kv-x").chmod(0o600)
    for path in ("/etc/hostname", str(tmp_path / "shoal-kv-x"), str(SHM_DIR / "other")):
        with pytest.raises(ValueError, match="is not a shoal KV file"):
            read_shared(SharedPlace(path, 0, 4), into)
    read_shared(SharedPlace(str(tmp_path / "shoal-kv-x"), 1, 3), memoryview(into)[:3],
                directory=tmp_path)
    assert bytes(into[:3]) == b"bcd"


def test_links_fifos_and_files_others_may_write_are_not_read(tmp_path) -> None:
    """A peer names the file: a link (to any file of this host), a FIFO (open would block the
    fetch thread for good) or a file group or others may write (cut short under the mapping:
    SIGBUS) is refused, and the fetch then takes the bytes over TCP."""
    import os

    into = bytearray(4)
    target = tmp_path / "shoal-kv-real"
    target.write_bytes(b"abcd")
    target.chmod(0o600)
    (tmp_path / "shoal-kv-link").symlink_to(target)
    with pytest.raises(OSError):
        read_shared(SharedPlace(str(tmp_path / "shoal-kv-link"), 0, 4), into,
                    directory=tmp_path)
    os.mkfifo(tmp_path / "shoal-kv-fifo", 0o600)
    with pytest.raises(ValueError, match="not a regular file"):
        read_shared(SharedPlace(str(tmp_path / "shoal-kv-fifo"), 0, 4), into,
                    directory=tmp_path)
    target.chmod(0o644)
    with pytest.raises(ValueError, match="mode 0600"):
        read_shared(SharedPlace(str(target), 0, 4), into, directory=tmp_path)


def test_only_loopback_peers_are_asked_for_shared_files() -> None:
    for host in ("127.0.0.1", "127.0.1.1", "::1", "[::1]", "localhost"):
        assert is_loopback(host), host
    for host in ("10.0.0.5", "192.168.1.2", "example.com", "", "::ffff:8.8.8.8"):
        assert not is_loopback(host), host
