"""The P2P connector's data path in pieces: the framed transport (a msgpack header, then raw
bytes into a buffer the consumer allocates), the readout of a prompt's rows into one host
buffer and their write into another cache of another block size, and the recycling pool of
host buffers."""

from __future__ import annotations

import gc
import socket
import threading

import numpy as np
import pytest
import torch

from shoal.core.kv_connector_plan import KVLayout
from shoal.kv_transfer.base import KVRows
from shoal.kv_transfer.payload import HostBufferPool
from shoal.kv_transfer.rows import check_layout, gather_rows, scatter_rows
from shoal.kv_transfer.transport import KVServer, Reply, fetch


def test_framed_bytes_arrive_whole_and_errors_come_back_as_headers() -> None:
    body = np.random.default_rng(0).integers(0, 256, 24 << 20, dtype=np.uint8)
    asked: list[object] = []

    def handler(req: dict) -> Reply:
        asked.append(req)
        if req["key"] == "missing":
            return Reply({"error": "no such key"})
        return Reply({"digest": "d"}, memoryview(body), ready=lambda: asked.append("ready"))

    server = KVServer("127.0.0.1", 0, handler)
    try:
        sizes: list[int] = []
        header, data = fetch("127.0.0.1", server.port, {"key": "k"}, 10.0,
                             alloc=lambda n: sizes.append(n) or memoryview(bytearray(n)))
        assert header == {"digest": "d", "nbytes": body.nbytes} and sizes == [body.nbytes]
        assert np.array_equal(np.frombuffer(data, dtype=np.uint8), body)
        assert asked == [{"key": "k"}, "ready"]  # ready() ran before the bytes went out
        header, data = fetch("127.0.0.1", server.port, {"key": "missing"}, 10.0)
        assert header == {"error": "no such key"} and data is None
        # a client that leaves mid-reply does not take the server down
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(b"\0\0\0\0\0\0\0\x05" + b"\x81\xa3key\xa1k")
            sock.recv(100)
        header, data = fetch("127.0.0.1", server.port, {"key": "k"}, 10.0)
        assert len(data) == body.nbytes
    finally:
        server.close()


def test_a_reply_cut_short_is_an_error() -> None:
    listener = socket.create_server(("127.0.0.1", 0))

    def serve_half() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(100)
            head = b"\x81\xa6nbytes\xcd\x03\xe8"  # {"nbytes": 1000}
            conn.sendall(len(head).to_bytes(8, "big") + head + b"x" * 10)

    thread = threading.Thread(target=serve_half, daemon=True)
    thread.start()
    try:
        with pytest.raises(ConnectionError, match="after 10 of 1000 bytes"):
            fetch("127.0.0.1", listener.getsockname()[1], {"key": "k"}, 10.0)
    finally:
        thread.join(5)
        listener.close()


def _cache(layers: int, slots: int, heads: int, dim: int, dtype: torch.dtype,
           seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, slots, heads, dim, generator=gen).to(dtype) for _ in range(layers)]


def _rows(caches: list[torch.Tensor], ids: list[int], bs: int, start: int, end: int
          ) -> list[torch.Tensor]:
    pos = torch.arange(start, end)
    slots = torch.tensor(ids)[pos // bs] * bs + pos % bs
    return [kv.view(torch.uint8)[:, slots] for kv in caches]


@pytest.mark.parametrize("dtype,dim", [(torch.bfloat16, 8), (torch.float16, 3),
                                       (torch.float8_e4m3fn, 5), (torch.float32, 4)],
                         ids=["bf16", "fp16-odd", "fp8-odd", "fp32"])
def test_rows_read_out_and_written_in_across_block_sizes(dtype, dim) -> None:
    n, layers = 45, 3
    src = _cache(layers, 16 * 4, 2, dim, dtype, seed=1)
    src_ids = [9, 2, 14, 5, 0, 11, 7, 3, 12, 1, 8, 4]  # blocks of 4: 48 slots for 45 tokens
    payload = gather_rows(src, src_ids, 4, n)
    payload.wait()
    assert payload.nbytes == layers * 2 * n * 2 * dim * src[0].element_size()
    dst = _cache(layers, 8 * 10, 2, dim, dtype, seed=2)
    dst_ids = [6, 1, 8, 3, 9, 0]  # blocks of 8
    before = _rows(dst, dst_ids, 8, 0, 16)
    # the consumer takes tokens [16, 44): its first 16 came from its own prefix cache
    scatter_rows(dst, payload.layout, payload.data, dst_ids, 8, 16, 28)
    assert all(torch.equal(a, b) for a, b in zip(_rows(dst, dst_ids, 8, 0, 16), before))
    for got, want in zip(_rows(dst, dst_ids, 8, 16, 44), _rows(src, src_ids, 4, 16, 44)):
        assert torch.equal(got, want)
    # a read-only copy of the bytes (as tensor-parallel ranks decode them) works as well
    dst2 = _cache(layers, 8 * 10, 2, dim, dtype, seed=3)
    scatter_rows(dst2, payload.layout, bytes(payload.data), dst_ids, 8, 0, n)
    for got, want in zip(_rows(dst2, dst_ids, 8, 0, n), _rows(src, src_ids, 4, 0, n)):
        assert torch.equal(got, want)


def test_a_payload_that_does_not_fit_the_cache_is_refused() -> None:
    src = _cache(2, 32, 2, 8, torch.bfloat16, seed=0)
    payload = gather_rows(src, [3, 1, 0], 8, 20)
    with pytest.raises(ValueError, match="2 layers, this model 3"):
        check_layout(_cache(3, 32, 2, 8, torch.bfloat16, 0), payload.layout, payload.nbytes)
    with pytest.raises(ValueError, match="is bfloat16, this cache torch.float32"):
        check_layout(_cache(2, 32, 2, 8, torch.float32, 0), payload.layout, payload.nbytes)
    with pytest.raises(ValueError, match="has 7 bytes"):
        check_layout(src, payload.layout, 7)
    with pytest.raises(ValueError, match="2 x 16 bytes a head, this cache.s 2 x 32"):
        check_layout(_cache(2, 32, 2, 16, torch.bfloat16, 0), payload.layout,
                     payload.nbytes)


def test_host_buffers_are_recycled_by_size_class() -> None:
    pool = HostBufferPool(max_free_bytes=8 << 20)
    first = pool.get(3 << 20)
    address = np.frombuffer(first, dtype=np.uint8).ctypes.data
    tensor = torch.frombuffer(first, dtype=torch.uint8)
    del first
    gc.collect()
    assert pool.free_bytes == 0  # the tensor still reads it
    del tensor
    gc.collect()
    assert pool.free_bytes == 3 << 20
    again = pool.get((3 << 20) - 100)  # the same size class: the same memory
    assert len(again) == (3 << 20) - 100
    assert np.frombuffer(again, dtype=np.uint8).ctypes.data == address
    big = pool.get(9 << 20)
    del big, again
    gc.collect()
    assert pool.free_bytes == 3 << 20  # over max_free_bytes: the big one was freed


def test_the_consumer_refuses_another_models_kv_before_loading_it() -> None:
    layout = KVLayout("bfloat16", 10, [[2, 10, 8, 256]] * 4)
    KVRows("bfloat16", [(2, 8, 256)] * 4).check(layout, 1)
    KVRows("bfloat16", [(2, 4, 256)] * 4).check(layout, 2)  # two ranks, 4 heads each
    for rows, world, match in [
            (KVRows("bfloat16", [(2, 8, 256)] * 3), 1, "4 layers, this model 3"),
            (KVRows("float16", [(2, 8, 256)] * 4), 1, "is bfloat16, this cache float16"),
            (KVRows("bfloat16", [(1, 8, 256)] * 4), 1, "do not fit"),
            (KVRows("bfloat16", [(2, 8, 128)] * 4), 1, "do not fit"),
            (KVRows("bfloat16", [(2, 2, 256)] * 4), 2, "do not fit")]:
        with pytest.raises(ValueError, match=match):
            rows.check(layout, world)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_readout_and_write_in_through_pinned_buffers() -> None:
    """On CUDA: the readout lands in pinned memory behind an event (`ready`), the write-in
    is queued from a pinned buffer that the runner keeps until the device has read it."""
    from shoal.core.kv_connector_plan import KVConnectorPlan, KVLoad
    from shoal.kv_transfer.payload import host_buffer
    from shoal.worker.kv_connector_step import _keeper, run_loads

    n = 300
    src = [kv.cuda() for kv in _cache(4, 16 * 40, 2, 64, torch.bfloat16, seed=4)]
    src_ids = torch.randperm(40)[:19].tolist()
    payload = gather_rows(src, src_ids, 16, n)
    assert payload.ready is not None
    payload.wait()
    data = host_buffer(payload.nbytes, pinned=True)
    data[:] = payload.data
    assert torch.frombuffer(data, dtype=torch.uint8).is_pinned()
    dst = [kv.cuda() for kv in _cache(4, 32 * 20, 2, 64, torch.bfloat16, seed=5)]
    dst_ids = torch.randperm(20)[:10].tolist()
    plan = KVConnectorPlan(loads=[KVLoad(0, dst_ids, 0, n, payload.layout, data)])
    run_loads(plan, dst, 32)
    assert len(_keeper) <= 1
    torch.cuda.synchronize()
    for got, want in zip(_rows(dst, dst_ids, 32, 0, n), _rows(src, src_ids, 16, 0, n)):
        assert torch.equal(got, want)
