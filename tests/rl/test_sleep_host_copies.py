"""Level-1 sleep keeps its host buffers between cycles (shoal/worker/sleep_mode.py HostCopies):
the first sleep allocates them, a second sleep copies into the very same buffers (same data
pointers, no allocation), a weight update that keeps every shape keeps them, a level-2 sleep
and shutdown release them; tokens after every wake-up are the tokens of before (or of a
fresh engine on the updated weights). On the CPU the buffers are plain memory (pinned on
CUDA: tests/rl/test_weight_copies_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from oracle import write_tiny_checkpoint
from safetensors.torch import load_file
from torch import nn

from shoal import LLM, SamplingParams
from shoal.worker.sleep_mode import HostCopies, kept_sizes, put_to_sleep, wake

ENGINE = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_memory_bytes=2**22)
PROMPTS = [{"prompt_token_ids": list(range(5, 45))}, {"prompt_token_ids": [9, 8, 7, 300]}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids)
            for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_slots_are_reused_while_their_size_holds() -> None:
    host = HostCopies()
    first = host.take([64, 128, 32], pinned=False)
    assert host.allocations == 3 and host.nbytes == 224
    again = host.take([64, 128, 32], pinned=False)
    assert [b.data_ptr() for b in again] == [b.data_ptr() for b in first]
    assert host.allocations == 3
    changed = host.take([64, 256], pinned=False)  # slot 1 grew, slot 2 is gone
    assert changed[0].data_ptr() == first[0].data_ptr()
    assert changed[1].numel() == 256 and host.allocations == 4 and host.nbytes == 320
    host.keep_if([64, 256])
    assert len(host.buffers) == 2
    host.keep_if([64, 255])  # (a weight update changed a size: nothing is kept)
    assert host.buffers == [] and host.nbytes == 0


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 4)
        self.register_buffer("table", torch.arange(6.0))
        self.scratch = nn.Parameter(torch.randn(16))  # (as offloading's staging buffer)


def test_module_sleeps_copy_into_the_same_buffers() -> None:
    torch.manual_seed(0)
    model = Tiny()
    want = {n: t.clone() for n, t in model.state_dict().items()}
    host = HostCopies()
    for cycle in range(2):
        asleep = put_to_sleep([model], 1, host, scratch=[model.scratch])
        assert all(t.untyped_storage().nbytes() == 0 for t in model.state_dict().values())
        copies = {id(t): c for t, _, c in asleep.storages}
        assert copies[id(model.scratch)] is None  # freed without a copy
        ptrs = [b.data_ptr() for b in host.buffers]
        if cycle == 0:
            first, allocated = ptrs, host.allocations
            assert allocated == 5  # a and b's weights and biases, the buffer
        assert ptrs == first and host.allocations == allocated
        wake(asleep)
        for name, t in model.state_dict().items():
            if name != "scratch":
                assert torch.equal(t, want[name]), name
    assert kept_sizes([model], [model.scratch]) == [b.numel() for b in host.buffers]
    # a size change replaces that slot and keeps the others (b's weight grew: 128 -> 160)
    model.b.weight.data = torch.randn(5, 8)
    asleep = put_to_sleep([model], 1, host, scratch=[model.scratch])
    ptrs = [b.data_ptr() for b in host.buffers]
    assert [b.numel() for b in host.buffers] == [256, 32, 160, 16, 24]
    assert host.allocations == allocated + 1
    assert [p == f for p, f in zip(ptrs, first)] == [True, True, False, True, True]
    wake(asleep)
    # level 2 copies the buffers only (fresh, not kept) and releases the kept ones
    asleep = put_to_sleep([model], 2, host)
    assert host.buffers == []
    assert [c is not None for t, _, c in asleep.storages if t is model.table] == [True]
    wake(asleep)
    assert torch.equal(model.table, want["table"])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple:
    root = tmp_path_factory.mktemp("sleep-host-copies")
    a = write_tiny_checkpoint(root / "a", "llama", seed=0)
    b = write_tiny_checkpoint(root / "b", "llama", seed=1)
    llm = LLM(model=str(b), **ENGINE)
    want_b = tokens(llm)
    llm.shutdown()
    return a, b, want_b


def test_engine_sleeps_reuse_host_buffers_until_level_2(checkpoints) -> None:
    a, b, want_b = checkpoints
    llm = LLM(model=str(a), **ENGINE)
    runner = llm.llm_engine.core.runner
    host = runner.host_copies
    try:
        want = tokens(llm)
        assert want != want_b
        assert llm.sleep(1)["host_buffers_allocated"] > 0
        ptrs = [t.data_ptr() for t in host.buffers]
        llm.wake_up()
        assert tokens(llm) == want
        assert llm.sleep(1)["host_buffers_allocated"] == 0
        assert [t.data_ptr() for t in host.buffers] == ptrs
        llm.wake_up()
        assert tokens(llm) == want
        # an update that changes no shape keeps the buffers for the next sleep
        llm.update_weights(load_file(str(b / "model.safetensors")))
        assert [t.data_ptr() for t in host.buffers] == ptrs
        assert tokens(llm) == want_b
        assert llm.sleep(1)["host_buffers_allocated"] == 0
        assert [t.data_ptr() for t in host.buffers] == ptrs
        llm.wake_up()
        assert tokens(llm) == want_b
        assert llm.collective_rpc("rank_info")[0]["host_copy_bytes"] == host.nbytes > 0
        # level 2 releases them; the next level-1 sleep allocates again
        llm.sleep(2)
        assert host.buffers == []
        llm.wake_up(["weights"])
        llm.update_weights_from_path(str(b))
        llm.wake_up(["kv_cache"])
        assert tokens(llm) == want_b
        assert llm.sleep(1)["host_buffers_allocated"] == len(host.buffers) > 0
        llm.wake_up()
        assert tokens(llm) == want_b
    finally:
        llm.shutdown()
    assert host.buffers == []  # released at shutdown
