"""The model's CPU threads are chosen: the cores the process can really use (affinity, cgroup
quota), at most torch's count, one less for the server's frontend; the engine process is
spawned with sleeping (not spinning) OpenMP threads."""

from __future__ import annotations

import os

import pytest
import torch

from shoal.engine import cpu_quota, cpu_threads
from shoal.engine.core_client import spawn_environment


def test_serving_leaves_a_core_to_the_frontend():
    choose = cpu_threads.choose_cpu_threads
    assert choose(None, serving=True, cores=2, torch_threads=2) == 1
    assert choose(None, serving=False, cores=2, torch_threads=2) == 2
    assert choose(None, serving=True, cores=1, torch_threads=1) == 1
    assert choose(3, serving=True, cores=2, torch_threads=1) == 3  # the user's count stands
    with pytest.raises(ValueError, match="cpu_threads"):
        choose(0, serving=True, cores=2, torch_threads=2)


def test_never_more_than_torch_count_nor_the_usable_cores():
    choose = cpu_threads.choose_cpu_threads
    # 8 physical cores, 16 hyperthreads: torch's default is 8
    assert choose(None, serving=False, cores=16, torch_threads=8) == 8
    assert choose(None, serving=True, cores=16, torch_threads=8) == 8
    # a 2-CPU quota on a 64-CPU host; OMP_NUM_THREADS=1
    assert choose(None, serving=False, cores=2, torch_threads=32) == 2
    assert choose(None, serving=False, cores=64, torch_threads=1) == 1


def _cgroup(tmp_path, proc_line: str, files: dict[str, str]):
    tmp_path.mkdir(exist_ok=True)
    proc = tmp_path / "cgroup"
    proc.write_text(proc_line + "\n")
    for rel, text in files.items():
        path = tmp_path / "fs" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return cpu_quota.cgroup_cpu_quota(tmp_path / "fs", proc)


def test_cgroup_v2_quota_takes_the_tightest_ancestor(tmp_path):
    assert _cgroup(tmp_path, "0::/a/b", {"a/cpu.max": "150000 100000\n",
                                         "a/b/cpu.max": "max 100000\n"}) == 1.5
    assert _cgroup(tmp_path / "u", "0::/", {"cpu.max": "max 100000\n"}) is None


def test_cgroup_v1_quota(tmp_path):
    files = {"cpu,cpuacct/docker/x/cpu.cfs_quota_us": "250000\n",
             "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n"}
    assert _cgroup(tmp_path, "4:cpu,cpuacct:/docker/x", files) == 2.5
    unlimited = {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}
    assert _cgroup(tmp_path / "u", "3:cpu:/", unlimited) is None


def test_usable_cores_is_affinity_capped_by_the_quota(monkeypatch):
    monkeypatch.setattr(cpu_quota, "affinity_cpus", lambda: frozenset(range(8)))
    monkeypatch.setattr(cpu_quota, "cgroup_cpu_quota", lambda: None)
    assert cpu_quota.usable_cores() == 8
    monkeypatch.setattr(cpu_quota, "cgroup_cpu_quota", lambda: 2.5)
    assert cpu_quota.usable_cores() == 2  # a thread on half a CPU stalls every region
    monkeypatch.setattr(cpu_quota, "cgroup_cpu_quota", lambda: 0.5)
    assert cpu_quota.usable_cores() == 1


def test_configure_sets_torch_threads_on_the_cpu_only(monkeypatch):
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    try:
        assert cpu_threads.configure_cpu_threads("cuda", 3, serving=True) is None
        assert torch.get_num_threads() == before
        assert cpu_threads.configure_cpu_threads("cpu", 1, serving=True) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_an_engine_starts_from_torch_count_not_an_earlier_engine_adapted_one(monkeypatch):
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 4)
    monkeypatch.setattr(cpu_threads, "_ours", None)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)  # the program's choice
        assert cpu_threads.configure_cpu_threads("cpu", None, serving=False) == 3
        cpu_threads.set_model_threads(1)  # what a governor adapted it to
        assert cpu_threads.configure_cpu_threads("cpu", None, serving=False) == 3
        torch.set_num_threads(2)  # the program changed it again: its count stands
        assert cpu_threads.configure_cpu_threads("cpu", None, serving=False) == 2
    finally:
        torch.set_num_threads(before)


def test_spawn_environment_is_temporary_and_respects_the_user(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with spawn_environment(cpu_threads.spawn_env()):
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert cpu_threads.spawn_env() == {}  # the user's choice stands
