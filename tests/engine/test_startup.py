"""The start-up sequence both engines share (shoal/engine/startup.py), with the model loading
and the EngineCore replaced by recorders: the order of the steps, and the one difference
between the server's engine and the offline one (`serving`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shoal.engine import startup
from shoal.engine.engine_args import EngineArgs


@pytest.fixture
def steps(monkeypatch):
    """The steps start_engine_core took, in order."""
    done: list = []
    loaded = SimpleNamespace(hf_config="hf", source="src", tokenizer="tok")
    monkeypatch.setattr(startup, "load_model", lambda *a, **k: done.append("load") or loaded)
    monkeypatch.setattr(startup, "configure_cpu_threads",
                        lambda device, n, serving: done.append(("threads", device, n, serving)))
    monkeypatch.setattr(EngineArgs, "apply_hf_overrides",
                        lambda self, hf: done.append("overrides"))
    monkeypatch.setattr(EngineArgs, "create_engine_config",
                        lambda self, hf, source, serving: done.append(("config", serving))
                        or "config")
    monkeypatch.setattr(startup, "generation_defaults",
                        lambda args, config, model: done.append("generation") or "defaults")
    monkeypatch.setattr(startup, "EngineCore", lambda config, model, request_limits, generation: (
        done.append("core") or SimpleNamespace(config=config, limits=request_limits,
                                               model=model, startup_times={},
                                               generation=generation)))
    seed = torch.initial_seed()
    yield done
    torch.manual_seed(seed)


def test_the_server_always_chooses_its_threads_and_short_steps(steps):
    started = startup.start_engine_core(EngineArgs(device="cpu", seed=7), serving=True)
    assert steps == [("threads", "cpu", None, True), "load", "overrides", ("config", True),
                     "generation", "core"]
    assert (started.core.config, started.tokenizer) == ("config", "tok")
    assert torch.initial_seed() == 7


def test_offline_chooses_its_threads_too(steps):
    startup.start_engine_core(EngineArgs(device="cpu"), serving=False)
    assert steps == [("threads", "cpu", None, False), "load", "overrides", ("config", False),
                     "generation", "core"]
    steps.clear()
    startup.start_engine_core(EngineArgs(device="cpu", cpu_threads=2), serving=False)
    assert steps[0] == ("threads", "cpu", 2, False)


def test_the_core_gets_a_thread_governor_unless_the_count_is_pinned(steps, monkeypatch):
    monkeypatch.setattr(startup, "configure_cpu_threads", lambda device, n, serving: n or 2)
    monkeypatch.setattr(startup, "thread_governor",
                        lambda device, threads, requested: ("governor", threads, requested))
    core = startup.start_engine_core(EngineArgs(device="cpu"), serving=False).core
    assert core.thread_governor == ("governor", 2, None)
    core = startup.start_engine_core(EngineArgs(device="cpu", cpu_threads=3), serving=True).core
    assert core.thread_governor == ("governor", 3, 3)


def test_request_limits_are_checked_before_the_model_loads(steps):
    with pytest.raises(ValueError, match="max_n"):
        startup.start_engine_core(EngineArgs(device="cpu", max_n=0), serving=True)
    assert steps == []
