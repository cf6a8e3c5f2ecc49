"""The GGUF reader against malformed files (issue 18: fuzz the GGUF reader with bounds-checked
sizes): every mutation of a valid file either loads or raises ValueError; none raises anything
else, takes long or allocates much. A deterministic run; benchmarks/fuzz_gguf.py runs long
ones and atheris."""

from __future__ import annotations

import random
import sys
import time
import tracemalloc
from pathlib import Path

from gguf_mutations import header_slots, load_everything, mutate, write_seed

sys.path.insert(0, str(Path(__file__).parent.parent / "loader"))  # gguf_factory

RUNS = 150


def test_malformed_gguf_files_raise_value_error_only(tmp_path):
    seed = write_seed(tmp_path / "seed.gguf")
    data, slots = seed.read_bytes(), header_slots(seed)
    load_everything(seed)  # the seed itself is valid
    rng = random.Random(0)
    path = tmp_path / "case.gguf"
    outcomes = {"ok": 0, "ValueError": 0}
    tracemalloc.start()
    try:
        for i in range(RUNS):
            path.write_bytes(mutate(data, slots, rng))
            tracemalloc.reset_peak()
            t0 = time.perf_counter()
            try:
                load_everything(path)
                outcomes["ok"] += 1
            except ValueError:
                outcomes["ValueError"] += 1
            elapsed = time.perf_counter() - t0
            peak = tracemalloc.get_traced_memory()[1]
            assert elapsed < 5, f"case {i} took {elapsed:.1f} s"
            assert peak < 256 << 20, f"case {i} allocated {peak >> 20} MiB"
    finally:
        tracemalloc.stop()
    assert outcomes["ValueError"] > RUNS // 3
