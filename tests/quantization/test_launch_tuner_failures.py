"""The launch tuner (shoal/layers/quantization/launch_tuner.py) when a candidate cannot run:
a kernel the GPU compiler refuses (the MXFP4 decode kernels' non-constexpr global on an
H100) is dropped, warned of once for all shape keys, and never reaches the caller. On the CPU
the CUDA calls the timer makes (streams, graphs, events) are stand-ins that only record."""

from __future__ import annotations

import contextlib
import logging

import torch

from shoal.layers.quantization import launch_tuner

REFUSED = "at 7:26: Cannot access global variable BYTES from within @jit'ed function"


class _FakeCuda:
    """torch.cuda as gpu_time_us uses it: every replay takes 2 us; which stream is current."""

    def __init__(self, monkeypatch):
        self.stream = "main"
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(cuda, "current_stream", lambda *a: self.stream)
        monkeypatch.setattr(cuda, "set_stream", lambda s: setattr(self, "stream", s))
        monkeypatch.setattr(cuda, "CUDAGraph", lambda: type("G", (), {"replay": lambda s: None})())
        monkeypatch.setattr(cuda, "graph", self._graph)
        monkeypatch.setattr(cuda, "Event", lambda **kw: type("E", (), {
            "record": lambda s: None, "synchronize": lambda s: None,
            "elapsed_time": lambda s, other: 2e-3 * launch_tuner.REPEATS})())
        monkeypatch.setattr(launch_tuner, "may_time", lambda device: True)
        monkeypatch.setattr(launch_tuner, "TUNED", {})
        monkeypatch.setattr(launch_tuner, "_FAILURES_LOGGED", set())

    @contextlib.contextmanager
    def _graph(self, graph, **kw):
        # torch.cuda.graph switches to a side stream; a failing capture_end leaves it current
        self.stream = "capture side stream"
        yield
        self.stream = "main"


def test_a_candidate_that_does_not_compile_is_dropped_and_warned_of_once(monkeypatch,
                                                                         caplog) -> None:
    _FakeCuda(monkeypatch)
    calls: list[str] = []

    def run(name: str) -> torch.Tensor:
        calls.append(name)
        if name == "refused":
            raise NameError(REFUSED)
        if name == "wrong shape":
            return torch.ones(3, 8)
        return torch.ones(4, 8)

    names = ("grouped", "refused", "wrong shape", "decode")
    with caplog.at_level(logging.DEBUG, logger=launch_tuner.__name__):
        for t in (1, 2):  # two shape keys: the same refusal twice
            out = launch_tuner.run_fastest(("mxfp4 experts", t), names, run,
                                           torch.device("cuda"))
            assert torch.equal(out, torch.ones(4, 8))
    for t in (1, 2):
        tuned = launch_tuner.TUNED[("mxfp4 experts", t)]
        assert tuned.times_us["refused"] == tuned.times_us["wrong shape"] == float("inf")
        assert tuned.choice in ("grouped", "decode")
    warned = [r for r in caplog.records if r.levelno == logging.WARNING and REFUSED in
              r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert "refused failed, dropped: NameError" in warned[0].getMessage()
    assert sum(REFUSED in r.getMessage() for r in caplog.records) == 2  # the 2nd at debug
    assert any("wrong shape disagrees" in r.getMessage() for r in caplog.records)
    # tuned: one look-up and one call of the pick, the refused candidate never again
    calls.clear()
    launch_tuner.run_fastest(("mxfp4 experts", 1), names, run, torch.device("cuda"))
    assert calls == [launch_tuner.TUNED[("mxfp4 experts", 1)].choice]


def test_a_capture_that_fails_leaves_the_stream_as_it_was(monkeypatch) -> None:
    fake = _FakeCuda(monkeypatch)
    warm = {"n": 0}

    def fn() -> None:  # runs eagerly, then fails inside the capture (a host sync, say)
        warm["n"] += 1
        if warm["n"] > launch_tuner.WARMUP:
            raise RuntimeError("operation not permitted when stream is capturing")

    assert launch_tuner.gpu_time_us(fn, "k capture") == float("inf")
    assert fake.stream == "main"


def test_out_of_resources_stays_at_debug(monkeypatch, caplog) -> None:
    """A tile too large for this GPU is an expected outcome of some candidates."""
    _FakeCuda(monkeypatch)
    OutOfResources = type("OutOfResources", (Exception,), {})

    def fn() -> None:
        raise OutOfResources("shared memory, Required: 262144, Hardware limit: 232448")

    with caplog.at_level(logging.DEBUG, logger=launch_tuner.__name__):
        assert launch_tuner.gpu_time_us(fn, "k big tile") == float("inf")
    assert [r.levelno for r in caplog.records] == [logging.DEBUG]


def test_a_failing_heuristic_pick_still_leaves_a_working_candidate(monkeypatch) -> None:
    _FakeCuda(monkeypatch)

    def run(name: str) -> torch.Tensor:
        if name == "grouped":
            raise NameError(REFUSED)
        return torch.full((2, 2), 3.0)

    out = launch_tuner.run_fastest(("k",), ("grouped", "decode"), run, torch.device("cuda"))
    assert torch.equal(out, torch.full((2, 2), 3.0))


def test_a_tighter_agreement_drops_what_the_default_keeps(monkeypatch) -> None:
    """A candidate 10% off the reference: kept at AGREE (FP8 activations differ by percents),
    dropped at EXACT_OPERANDS_AGREE (the MXFP4 experts, the dense GEMVs)."""
    _FakeCuda(monkeypatch)

    def run(name: str) -> torch.Tensor:
        return torch.full((4,), 1.0 if name == "ref" else 1.1)

    cuda = torch.device("cuda")
    launch_tuner.run_fastest(("loose",), ("ref", "off"), run, cuda)
    launch_tuner.run_fastest(("tight",), ("ref", "off"), run, cuda,
                             launch_tuner.EXACT_OPERANDS_AGREE)
    assert launch_tuner.TUNED[("loose",)].times_us["off"] < float("inf")
    assert launch_tuner.TUNED[("tight",)].times_us["off"] == float("inf")


def test_cold_timing_reads_past_the_l2_first_and_subtracts_that_read(monkeypatch) -> None:
    """SHOAL_QUANT_TUNING_COLD=1: each timed call comes after the L2 flush, and the flush's own
    time is taken off (here a flush costs 3 us and the candidate 2 us); unset: no flush."""
    _FakeCuda(monkeypatch)
    order: list[str] = []
    graphs: list[list[str]] = []
    monkeypatch.setattr(launch_tuner, "_l2_flush", lambda device: lambda: order.append("flush"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def graph_us(fn) -> float:  # one call shows what a graph of fn would hold
        order.clear()
        fn()
        graphs.append(list(order))
        return 3.0 * order.count("flush") + 2.0 * order.count("fn")

    monkeypatch.setattr(launch_tuner, "graph_us", graph_us)
    monkeypatch.setenv("SHOAL_QUANT_TUNING_COLD", "1")
    assert launch_tuner.gpu_time_us(lambda: order.append("fn"), "k cold") == 2.0
    assert graphs == [["flush", "fn"], ["flush"]]
    graphs.clear()
    monkeypatch.delenv("SHOAL_QUANT_TUNING_COLD")
    assert launch_tuner.gpu_time_us(lambda: order.append("fn"), "k warm") == 2.0
    assert graphs == [["fn"]]


def test_a_cold_time_lost_in_the_flush_s_noise_drops_the_candidate(monkeypatch) -> None:
    """A candidate whose flush+call graph is no slower than the flush alone has no cold time
    to compare: inf (not a warm time beside the others' cold ones)."""
    _FakeCuda(monkeypatch)
    monkeypatch.setattr(launch_tuner, "_l2_flush", lambda device: lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(launch_tuner, "graph_us", lambda fn: 3.0)  # flush + fn == flush
    monkeypatch.setenv("SHOAL_QUANT_TUNING_COLD", "1")
    assert launch_tuner.gpu_time_us(lambda: None, "k noise") == float("inf")
