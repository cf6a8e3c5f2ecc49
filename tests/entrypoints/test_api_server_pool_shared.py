"""What the API processes of `--api-server-count N` share (pool_state.py), without a server:
two views of one pool file stand for two processes (SQLite locks two connections of one
process against each other as it does two processes). The server itself is checked in
test_api_server_count.py."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from lora.peft_adapters import write_raw_adapter  # tests/lora

from shoal.entrypoints.openai.errors import OpenAIError
from shoal.entrypoints.openai.pool_adapters import SharedAdapters
from shoal.entrypoints.openai.pool_state import PoolShared
from shoal.entrypoints.openai.response_store import ResponseStore, SharedResponseStore
from shoal.entrypoints.openai.server_settings import ServerSettings
from shoal.entrypoints.openai.serving_models import ServedModels
from shoal.lora.adapter import LoRALimits

TARGETS = {f"model.layers.0.self_attn.{p}": (64, out) for p, out in (("q_proj", 64),
                                                                      ("v_proj", 32))}


@pytest.fixture
def shared(tmp_path):
    pool = PoolShared.create(ServerSettings(api_server_count=2, max_stored_responses=4),
                             [("boot", str(tmp_path / "boot"), None)])
    yield pool
    pool.remove()
    assert not Path(pool.folder).exists()


def _response(i: int) -> tuple[dict, list]:
    return {"id": f"resp_{i}", "output": [{"text": f"answer {i}"}], "n": i / 3}, \
        [{"role": "user", "content": f"question {i}"}]


def test_responses_are_shared_and_bounded_like_the_one_process_store(shared):
    a, b = (SharedResponseStore(shared.file, 4) for _ in range(2))
    alone = ResponseStore(4)

    async def put_all() -> None:
        for i in range(7):
            await (a if i % 2 else b).put(*_response(i))
            await alone.put(*_response(i))

    asyncio.run(put_all())
    for store in (a, b, alone):  # the newest four, whichever process stored them
        for i in range(3):
            with pytest.raises(OpenAIError) as e:
                store.get(f"resp_{i}")
            assert e.value.status == 404 and "last 4" in e.value.message
        assert [store.get(f"resp_{i}") for i in range(3, 7)] == [_response(i)
                                                                  for i in range(3, 7)]
        with pytest.raises(OpenAIError) as e:
            store.get("msg_1", "previous_response_id")
        assert e.value.status == 400 and e.value.param == "previous_response_id"
    for store in (a, b):
        store.close()


def test_concurrent_writers_lose_nothing_and_keep_the_bound(shared):
    """Two writers at once (each its own thread and connections, as two processes): every
    write lands and is found by the other at once; the next write trims to the bound."""
    stores = [SharedResponseStore(shared.file, 1000) for _ in range(2)]
    seen: list[list[str]] = [[], []]

    def writer(k: int) -> None:
        async def run() -> None:
            for i in range(40):
                rid = f"resp_{k}_{i}"
                await stores[k].put({"id": rid}, [])
                stores[1 - k].get(rid)  # committed before put returns: the other finds it
                seen[k].append(rid)
        asyncio.run(run())

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [len(s) for s in seen] == [40, 40]

    def rows() -> int:
        return stores[0]._reader.execute("SELECT count(*) FROM responses").fetchone()[0]

    assert rows() == 80
    small = SharedResponseStore(shared.file, 4)
    asyncio.run(small.put({"id": "resp_last"}, []))
    assert rows() == 4 and stores[0].get("resp_last") == ({"id": "resp_last"}, [])
    for store in (*stores, small):
        store.close()


def _models() -> ServedModels:
    return ServedModels(["base"], None, 128, LoRALimits(2, 8, TARGETS))


def test_adapters_loaded_through_one_view_reach_the_other_with_one_id(shared, tmp_path):
    write_raw_adapter(tmp_path / "boot", TARGETS, seed=0)
    folders = {n: str(write_raw_adapter(tmp_path / n, TARGETS, seed=s))
               for n, s in (("a", 1), ("b", 2))}
    views = [SharedAdapters(shared.file, shared.cells, shared.adapters_cell)
             for _ in range(2)]
    models = [_models() for _ in range(2)]
    for view, m in zip(views, models):
        view.refresh(m)  # what AdapterRefresh does before each request
        assert {n: lora.lora_int_id for n, lora in m.loras.items()} == {"boot": 1}

    async def scenario() -> None:
        la = await views[0].load(models[0], "a", folders["a"], None)
        lb = await views[1].load(models[1], "b", folders["b"], "base")
        assert (la.lora_int_id, lb.lora_int_id) == (2, 3)
        with pytest.raises(OpenAIError) as e:  # the other view's name, seen at once
            await views[1].load(models[1], "a", folders["a"], None)
        assert e.value.status == 400 and "already been loaded" in e.value.message
        with pytest.raises(OpenAIError) as e:  # and the checks of ServedModels.load_lora
            await views[1].load(models[1], "c", str(tmp_path / "missing"), None)
        assert e.value.status == 400 and e.value.param == "lora_path"
        views[0].refresh(models[0])
        assert models[0].loras == models[1].loras and models[0].lora("b") == lb
        gone = await views[1].unload(models[1], "a")
        assert gone == la
        views[0].refresh(models[0])
        assert set(models[0].loras) == {"boot", "b"}
        with pytest.raises(OpenAIError) as e:
            await views[0].unload(models[0], "a")
        assert e.value.status == 404
        again = await views[0].load(models[0], "a", folders["a"], None)
        assert again.lora_int_id == 4  # never reused: an id names one adapter for good

    asyncio.run(scenario())


def test_load_cells_sum_and_a_dead_process_is_forgotten(shared):
    shared.cells[0] += 2
    shared.cells[1] += 1
    shared.cells[shared.adapters_cell] = 7  # (the adapters' version is no request)
    assert shared.requests_in_flight() == 3
    shared.process_gone(0)
    assert shared.requests_in_flight() == 1
