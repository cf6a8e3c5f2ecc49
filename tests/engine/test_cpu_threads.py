"""The model's CPU threads are chosen: all cores but the frontend's when serving, and the
engine process is spawned with sleeping (not spinning) OpenMP threads."""

from __future__ import annotations

import os

import pytest

from shoal.engine import cpu_threads
from shoal.engine.core_client import spawn_environment


def test_serving_leaves_a_core_to_the_frontend(monkeypatch):
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 2)
    assert cpu_threads.choose_cpu_threads(None, serving=True) == 1
    assert cpu_threads.choose_cpu_threads(None, serving=False) == 2
    monkeypatch.setattr(cpu_threads, "available_cores", lambda: 1)
    assert cpu_threads.choose_cpu_threads(None, serving=True) == 1
    assert cpu_threads.choose_cpu_threads(3, serving=True) == 3
    with pytest.raises(ValueError, match="cpu_threads"):
        cpu_threads.choose_cpu_threads(0, serving=True)


def test_configure_sets_torch_threads_on_the_cpu_only():
    import torch

    before = torch.get_num_threads()
    try:
        assert cpu_threads.configure_cpu_threads("cuda", 3, serving=True) is None
        assert torch.get_num_threads() == before
        assert cpu_threads.configure_cpu_threads("cpu", 1, serving=True) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_spawn_environment_is_temporary_and_respects_the_user(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with spawn_environment(cpu_threads.spawn_env()):
        assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in os.environ
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert cpu_threads.spawn_env() == {}  # the user's choice stands
