"""Run as a script by test_disk_crash_safety.py: writes KV blocks to a disk tier and stops
for good in the middle of one file's write (after `keep` whole files), printing MID-WRITE, so
the test can SIGKILL it exactly there.

    python disk_crash_child.py tier ROOT KEEP
    python disk_crash_child.py engine ROOT KEEP MODEL_DIR

or leaves its blocks in the CPU tier and exits without shutting the engine down, so only the
interpreter-exit hook can persist them (review finding 4):

    python disk_crash_child.py atexit ROOT -1 MODEL_DIR
"""

from __future__ import annotations

import os
import sys
import threading

import shoal.kv_offload.disk_format as fmt


def _hang_after(keep: int) -> None:
    real = fmt._writev_full
    done = [0]

    def writev(fd: int, bufs: list) -> None:
        if done[0] == keep:
            os.write(fd, bytes(bufs[0]) + bytes(bufs[1])[:100])  # header and a bit of data
            print("MID-WRITE", flush=True)
            threading.Event().wait()  # until SIGKILL
        real(fd, bufs)
        done[0] += 1

    fmt._writev_full = writev


def _tier(root: str) -> None:
    from tier_fixtures import _disk, _h, _payload

    disk = _disk(root, 64, background=True)
    for i in range(64):
        disk.store([_h(i)], _payload(i))
    disk.drain()


def _engine(root: str, model_dir: str) -> None:
    from test_disk_crash_safety import P, engine_with_disk

    from shoal.kv_offload.control import persist

    llm = engine_with_disk(model_dir, root)
    llm.generate(P, use_tqdm=False)
    persist(llm.llm_engine.core)  # device and CPU blocks down to the disk


def _atexit(root: str, model_dir: str) -> None:
    """Two engines keep P's blocks in their CPU tier only; one is dropped (garbage), the
    other is alive when the interpreter exits. Neither is shut down."""
    global _ALIVE
    from test_disk_crash_safety import P, engine_with_disk

    from shoal.kv_offload.control import offload_device_prefix_cache

    for sub in ("dropped", "alive"):
        llm = engine_with_disk(model_dir, os.path.join(root, sub))
        llm.generate(P, use_tqdm=False)
        offload_device_prefix_cache(llm.llm_engine.core)  # in the CPU tier, not on disk
        assert os.listdir(llm.llm_engine.core.kv_offload.tier("disk").dir) == ["key.json"]
        _ALIVE = llm
    del llm


_ALIVE = None


if __name__ == "__main__":
    mode, root, keep = sys.argv[1], sys.argv[2], int(sys.argv[3])
    if keep >= 0:
        _hang_after(keep)
    if mode == "tier":
        _tier(root)
    elif mode == "engine":
        _engine(root, sys.argv[4])
    else:
        _atexit(root, sys.argv[4])
    print("FINISHED WITHOUT HANGING", flush=True)
