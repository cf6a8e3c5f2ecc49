"""The CPU KV pool's huge-page backing (shoal/worker/host_pages.py): contents stay zeros,
the budget bounds the populate, the switch turns it off, and it never fails allocation."""

from __future__ import annotations

import torch

from shoal import envs
from shoal.worker import host_pages
from shoal.worker.kv_cache_sizing import zeroed_host_tensor


def test_populate_keeps_zeros_and_reports_bytes() -> None:
    t = zeroed_host_tensor((4, 2, 1 << 20), torch.uint8)  # 8 planes of 1 MiB
    done = host_pages.populate(t, planes=8, budget_s=5.0)
    if host_pages.huge_pages_available() and host_pages._madvise() is not None:
        assert done in (0, t.numel())  # 0 where the kernel lacks MADV_POPULATE_WRITE
    else:
        assert done == 0
    assert int(t.count_nonzero()) == 0
    t[1, 1, 5] = 7  # still ordinary memory
    assert int(t.sum()) == 7


def test_budget_and_switch(monkeypatch) -> None:
    t = zeroed_host_tensor((1 << 22,), torch.uint8)
    assert host_pages.populate(t, budget_s=0.0) == 0  # no time: nothing populated
    monkeypatch.setenv(envs.SHOAL_KV_HUGE_PAGES.name, "0")
    assert host_pages.populate(t, budget_s=5.0) == 0
    assert host_pages.populate(torch.zeros(3, device="meta"), budget_s=5.0) == 0
