"""Fetched KV for tensor-parallel ranks of one host (kv_transfer/shared.py): the step's plan
carries a handle of a few dozen bytes instead of the payload, each rank maps its own link of
the shared file and reads only its KV heads (about total / tp bytes), writing the same rows
as the bytes themselves would; every file is gone once the ranks have mapped their links, a
payload dropped before admission takes its file along, and without shared memory the bytes
travel as before."""

from __future__ import annotations

import gc

import msgspec
import pytest
import torch

from shoal.core.kv_connector_plan import KVConnectorPlan, KVLoad
from shoal.kv_transfer import rows as rows_module
from shoal.kv_transfer.rows import gather_rows, scatter_rows
from shoal.kv_transfer.shared import SegmentMaker, SharedRows, open_rows, to_ranks

HEADS, DIM, LAYERS, N = 4, 8, 3, 21


def _cache(slots: int, heads: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, slots, heads, DIM, generator=gen) for _ in range(LAYERS)]


def _rows(caches: list[torch.Tensor], ids: list[int], bs: int, start: int, end: int
          ) -> list[torch.Tensor]:
    pos = torch.arange(start, end)
    slots = torch.tensor(ids)[pos // bs] * bs + pos % bs
    return [kv[:, slots] for kv in caches]


def _as_rank(monkeypatch, rank: int, world: int) -> None:
    monkeypatch.setattr(rows_module, "get_tp_rank", lambda: rank)
    monkeypatch.setattr(rows_module, "get_tp_world_size", lambda: world)


@pytest.mark.parametrize("world", [2, 4])
def test_each_rank_reads_only_its_heads_from_shared_memory(tmp_path, monkeypatch, world
                                                          ) -> None:
    src_ids = [5, 0, 3, 7, 1, 6]  # blocks of 4: 24 slots for 21 tokens
    src = _cache(8 * 4, HEADS, seed=0)
    payload = gather_rows(src, src_ids, 4, N)
    total = payload.nbytes
    maker = SegmentMaker(tmp_path)
    view = maker.segment(total)
    assert view is not None
    view[:] = payload.data  # (the consumer receives into it straight from the socket)
    handle = to_ranks(view, world)
    del view
    gc.collect()
    assert isinstance(handle, SharedRows) and handle.nbytes == total
    assert sorted(p.name[-2:] for p in tmp_path.iterdir()) == [f".{r}" for r in range(world)]

    # what the step broadcast carries for this load: the handle, not the bytes
    dst_ids = [2, 0, 1]  # blocks of 8
    start, n = 3, N - 3  # the first 3 tokens from the consumer's own prefix cache
    sent = msgspec.msgpack.encode(KVConnectorPlan(loads=[
        KVLoad(7, dst_ids, start, n, payload.layout, handle)]))
    with_bytes = msgspec.msgpack.encode(KVConnectorPlan(loads=[
        KVLoad(7, dst_ids, start, n, payload.layout, payload.data)]))
    assert len(sent) < 400 < total < len(with_bytes)
    (load,) = msgspec.msgpack.decode(sent, type=KVConnectorPlan).loads  # as a rank gets it

    local = HEADS // world
    for rank in range(world):
        _as_rank(monkeypatch, rank, world)
        dst = _cache(8 * 3, local, seed=10 + rank)
        read = scatter_rows(dst, load.layout, open_rows(load.data, rank), load.block_ids, 8,
                            load.start, load.num_tokens)
        assert read == total // world * n // N  # its heads of tokens [start, N), no more
        heads = slice(rank * local, (rank + 1) * local)
        for got, want in zip(_rows(dst, dst_ids, 8, start, N),
                             _rows(src, src_ids, 4, start, N)):
            assert torch.equal(got, want[:, :, heads])
        # the bytes themselves (the broadcast) write the same rows, reading as little
        again = _cache(8 * 3, local, seed=10 + rank)
        assert scatter_rows(again, load.layout, bytes(payload.data), dst_ids, 8, start,
                            n) == read
        assert all(torch.equal(a, b) for a, b in zip(again, dst))
    assert list(tmp_path.iterdir()) == []  # every rank unlinked its name on mapping it


def test_segments_are_cleaned_up_and_missing_shared_memory_falls_back(tmp_path) -> None:
    maker = SegmentMaker(tmp_path)
    dropped = maker.segment(1000)  # fetched, then the request went away unadmitted
    assert dropped is not None and len(list(tmp_path.iterdir())) == 1
    del dropped
    gc.collect()
    assert list(tmp_path.iterdir()) == []
    kept = maker.segment(1000)
    to_ranks(kept, 2)  # admitted, but its step never ran (a failed step)
    assert len(list(tmp_path.iterdir())) == 2
    assert maker.sweep() == 2 and list(tmp_path.iterdir()) == []  # the connector's shutdown
    # no shared memory here, or an empty payload: the bytes are sent as before
    assert SegmentMaker(tmp_path / "missing").segment(1000) is None
    assert maker.segment(0) is None
    plain = memoryview(bytearray(16))
    assert to_ranks(plain, 2) is plain and open_rows(plain, 1) is plain
