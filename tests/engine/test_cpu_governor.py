"""The CPU engine's thread count follows the CPU other processes leave it
(shoal/engine/cpu_governor.py, cpu_share.py): the decisions with a scripted meter and clock,
the meter on /proc/stat text, and that the count set on the model's thread reaches the
OpenMP regions of torch and of shoal's C++ kernels."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from shoal.engine import cpu_governor
from shoal.engine.cpu_governor import ThreadGovernor, next_thread_count, thread_governor
from shoal.engine.cpu_share import CpuShareMeter, read_cpu_busy


def test_one_window_decisions():
    # 2 CPUs: a busy-looping neighbour (0.7-1.0 CPUs seen) sends 2 threads to 1
    assert next_thread_count(2, 2, free_cores=2.0 - 0.7) == 1
    assert next_thread_count(2, 2, free_cores=1.0) == 1
    assert next_thread_count(2, 2, free_cores=2.0 - 0.2) == 2  # background noise: stay
    assert next_thread_count(1, 2, free_cores=1.8) == 1  # inside the hysteresis band
    assert next_thread_count(1, 2, free_cores=1.9) == 2
    assert next_thread_count(1, 1, free_cores=4.0) == 1  # never above the start's count
    assert next_thread_count(2, 2, free_cores=0.0) == 1  # never below 1
    # 16 CPUs, 12 threads: a neighbour takes 6 of the free ones
    assert next_thread_count(12, 12, free_cores=10.0) == 10
    assert next_thread_count(10, 12, free_cores=16.0) == 12


class ScriptedMeter:
    """others_cores() returns the scripted values in turn (the first call is the baseline)."""

    num_cpus = 2

    def __init__(self, values):
        self.values = list(values)

    def others_cores(self):
        return self.values.pop(0)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _governor(values, ceiling=2):
    clock, applied = Clock(), []
    gov = ThreadGovernor(ceiling=ceiling, meter=ScriptedMeter(values),
                         set_threads=applied.append, clock=clock)
    return gov, clock, applied


def test_down_at_once_up_after_two_windows():
    gov, clock, applied = _governor([1.0, 1.0, 0.0, 0.0, 0.05])
    for t, threads in ((0.2, 2), (0.6, 1), (1.2, 1), (1.8, 1), (2.4, 2), (3.0, 2)):
        clock.t = t
        gov.after_step()
        assert gov.threads == threads, t
    assert applied == [1, 2]
    assert gov.changes == 2
    assert gov.seconds_at == pytest.approx({2: 0.6 + 0.6, 1: 0.6 + 0.6 + 0.6})


def test_a_short_burst_does_not_flip_the_count_back():
    gov, clock, applied = _governor([1.0, 0.0, 1.0, 0.0, 0.0])
    for i in range(1, 6):
        clock.t = 0.6 * i
        gov.after_step()
    assert applied == [1, 2]  # up only after the last two quiet windows


def test_a_long_step_is_measured_whole():
    gov, clock, applied = _governor([None, 1.2])
    clock.t = 12.0  # a 12 s prefill step; the meter had no reading (None): no change
    gov.after_step()
    assert applied == [] and gov.threads == 2
    clock.t = 30.0
    gov.after_step()
    assert applied == [1] and gov.seconds_at == {2: 18.0}


def test_no_governor_where_nothing_can_adapt(monkeypatch):
    assert thread_governor("cuda", None, None) is None
    assert thread_governor("cpu", 1, None) is None
    assert thread_governor("cpu", 2, 2) is None  # cpu_threads pins the count
    monkeypatch.setenv("SHOAL_CPU_ADAPTIVE_THREADS", "0")
    assert thread_governor("cpu", 2, None) is None
    monkeypatch.delenv("SHOAL_CPU_ADAPTIVE_THREADS")
    monkeypatch.setattr(cpu_governor, "affinity_cpus", lambda: None)  # not Linux
    assert thread_governor("cpu", 2, None) is None


STAT = """cpu  300 0 100 900 0 0 0 0 0 0
cpu0 100 0 50 400 0 0 0 0 0 0
cpu1 {u1} 0 50 500 7 0 {si} {st} 0 0
cpu2 999 0 999 0 0 0 0 0 0 0
intr 12345
"""


def test_meter_counts_others_busy_time_on_our_cpus():
    assert read_cpu_busy(frozenset({0, 1}), STAT.format(u1=200, si=0, st=0), 0.01) == 4.0
    texts = iter([STAT.format(u1=200, si=0, st=0), STAT.format(u1=280, si=5, st=15)])
    own, wall = iter([10.0, 10.3]), iter([0.0, 1.0])
    meter = CpuShareMeter(frozenset({0, 1}), read_stat=lambda: next(texts),
                          own_cpu=lambda: next(own), clock=lambda: next(wall), tick=0.01)
    assert meter.others_cores() is None  # the baseline
    # 1.0 s busy on cpu 0-1 (user, softirq, steal; cpu2 is not ours) less our own 0.3 s
    assert meter.others_cores() == pytest.approx(0.7)
    assert meter.num_cpus == 2


def test_meter_on_this_machine():
    meter = CpuShareMeter.for_cpus(frozenset({0}))
    if meter is None:
        pytest.skip("no /proc/stat")
    assert meter.others_cores() is None or meter.others_cores() >= 0.0


def test_the_count_is_set_on_the_thread_that_steps():
    """The default set_threads reaches torch on the calling thread (OpenMP keeps the count
    per thread: the governor runs inside EngineCore.step, on the model's thread)."""
    seen = []

    def engine_thread():
        torch.set_num_threads(2)
        gov = ThreadGovernor(ceiling=2, meter=ScriptedMeter([1.0]), clock=Clock())
        gov.clock.t = 1.0
        gov.after_step()
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=engine_thread)
    t.start()
    t.join()
    assert seen == [1]


_KERNEL_THREADS = textwrap.dedent("""
    import os, torch
    from shoal import cpu_kernels
    if not cpu_kernels.layer_ops_enabled():
        print("skip"); raise SystemExit
    from shoal.layers.ops.cpu_layer_ops import rms_norm
    x, w = torch.randn(4096, 512), torch.ones(512)
    def os_threads():
        for _ in range(20):
            rms_norm(x, w, 1e-6)
        return len(os.listdir("/proc/self/task"))
    torch.set_num_threads(1)
    one = os_threads()
    torch.set_num_threads(3)
    print(one, os_threads())
""")


def test_cpp_kernels_openmp_regions_follow_torch_thread_count():
    """The C++ kernels' parallel regions run in torch's OpenMP runtime (one libgomp), so the
    count set through torch is theirs: no pool threads at 1, two more at 3."""
    out = subprocess.run([sys.executable, "-c", _KERNEL_THREADS], capture_output=True,
                         text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    if out.stdout.strip() == "skip":
        pytest.skip("the C++ CPU kernels are not built")
    one, three = map(int, out.stdout.split())
    assert three - one == 2


def test_the_offline_engine_gives_up_a_thread_beside_a_neighbour(tiny_llama_dir, monkeypatch):
    """End to end: EngineCore.step runs the governor; with another process seen on one of two
    CPUs the model's threads drop to one during generate, and a later engine in the same
    process starts from the program's count again."""
    from engine_helpers import random_prompts, tiny_llm

    from shoal import SamplingParams

    meter = ScriptedMeter([1.0] * 100)
    monkeypatch.setattr(cpu_governor.CpuShareMeter, "for_cpus", lambda cpus: meter)
    monkeypatch.setattr(cpu_governor, "INTERVAL_S", 0.0)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        llm = tiny_llm(tiny_llama_dir)
        gov = llm.llm_engine.core.thread_governor
        assert (gov.ceiling, gov.threads, torch.get_num_threads()) == (2, 2, 2)
        llm.generate(random_prompts(2, seed=0), SamplingParams(max_tokens=4), use_tqdm=False)
        assert (gov.threads, torch.get_num_threads()) == (1, 1)
        assert tiny_llm(tiny_llama_dir).llm_engine.core.thread_governor.ceiling == 2
        pinned = tiny_llm(tiny_llama_dir, cpu_threads=2)
        assert pinned.llm_engine.core.thread_governor is None
    finally:
        torch.set_num_threads(before)
