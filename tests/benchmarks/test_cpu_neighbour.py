"""benchmarks/cpu_neighbour.py without an engine: the neighbour is a separate busy process only
in busy phases, and the summary's medians and busy/quiet slowdowns."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import cpu_neighbour  # noqa: E402


def test_phases_alternate():
    assert cpu_neighbour.phases(2) == ["quiet", "busy", "quiet", "busy"]


def test_the_neighbour_is_a_busy_process_while_open():
    with cpu_neighbour.Neighbour(False) as quiet:
        assert quiet.proc is None
    with cpu_neighbour.Neighbour(True) as busy:
        proc = busy.proc
        assert proc is not None and proc.poll() is None
        stat = Path(f"/proc/{proc.pid}/stat")
        if stat.exists():  # a busy loop: running, not sleeping
            assert stat.read_text().rsplit(")", 1)[1].split()[0] == "R"
    assert proc.poll() is not None


def test_summary_medians_and_slowdowns():
    rows = [{"phase": "quiet", "output_tok_s": 100.0, "batch1_tok_s": 60.0},
            {"phase": "busy", "output_tok_s": 40.0, "batch1_tok_s": 30.0},
            {"phase": "quiet", "output_tok_s": 80.0, "batch1_tok_s": 50.0},
            {"phase": "busy", "output_tok_s": 20.0, "batch1_tok_s": None}]
    s = cpu_neighbour.summarize({"phases": rows})
    assert s["output_tok_s_quiet"] == 90.0 and s["output_tok_s_busy"] == 30.0
    assert s["w6_slowdown_busy_over_quiet"] == 3.0 and not s["w6_within_goal"]
    assert s["batch1_slowdown_busy_over_quiet"] == pytest.approx(55 / 30, abs=0.01)
    assert s["batch1_within_goal"]
