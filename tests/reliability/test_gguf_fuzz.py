"""The GGUF reader against malformed files (issue 18: fuzz the GGUF reader with bounds-checked
sizes): every mutation of a valid file either loads or raises ValueError; none raises anything
else, takes long or allocates much. A deterministic run; benchmarks/fuzz_gguf.py runs long
ones and atheris."""

from __future__ import annotations

import itertools
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


def test_arrays_claiming_more_items_than_the_file_holds(tmp_path):
    """An array of 2**63 scalars once made the reader loop on empty reads past the end of the
    file (found by atheris): every read is bounds-checked now, and counts are capped."""
    from gguf import GGUFReader, GGUFValueType

    seed = write_seed(tmp_path / "seed.gguf")
    data = seed.read_bytes()
    arrays = [f for f in GGUFReader(seed).fields.values()
              if f.types and f.types[0] == GGUFValueType.ARRAY]
    assert arrays
    path = tmp_path / "case.gguf"
    for f, count, item_type in itertools.product(arrays, (2**63 - 1, 2**40, len(data)),
                                                 (None, GGUFValueType.UINT8)):
        item_at = f.offset + sum(int(p.nbytes) for p in f.parts[:3])  # after key and type
        b = bytearray(data)
        if item_type is not None:  # bytes: reads never misalign, so only a check ends them
            b[item_at:item_at + 4] = int(item_type).to_bytes(4, "little")
        b[item_at + 4:item_at + 12] = count.to_bytes(8, "little")
        path.write_bytes(bytes(b))
        t0 = time.perf_counter()
        try:
            load_everything(path)
        except ValueError:
            pass
        assert time.perf_counter() - t0 < 5, (f.name, count, item_type)
