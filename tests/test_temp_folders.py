"""Temporary folders of exited shoal processes are swept when the next one is made."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from shoal import temp_folders


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_dead_makers_folder_goes_and_live_ones_stay(tmp_path):
    ns = temp_folders._pid_namespace()
    dead = tmp_path / f"shoal-ipc-p{_dead_pid()}n{ns}-abc"
    other_kind = tmp_path / f"shoal-pool-p{_dead_pid()}n{ns}-abc"
    other_ns = tmp_path / f"shoal-ipc-p{_dead_pid()}n{ns + 1}-abc"
    live = tmp_path / f"shoal-ipc-p{os.getpid()}n{ns}-abc"
    unrelated = tmp_path / "shoal-ipc-abc"  # an old-style name: not ours to judge
    for d in (dead, other_kind, other_ns, live, unrelated):
        d.mkdir()
        (d / "output").write_text("socket")
    made = temp_folders.make_temp_folder("ipc", str(tmp_path))
    assert not dead.exists()
    assert other_kind.exists() and other_ns.exists() and live.exists() and unrelated.exists()
    assert os.path.basename(made).startswith(f"shoal-ipc-p{os.getpid()}n{ns}-")
    # this process's own folder survives its next call
    temp_folders.make_temp_folder("ipc", str(tmp_path))
    assert os.path.isdir(made)


def test_a_kind_must_be_lower_case_letters(tmp_path):
    with pytest.raises(ValueError, match="lower-case letters"):
        temp_folders.make_temp_folder("ipc-1", str(tmp_path))


def test_a_killed_engines_kv_segments_go_when_the_next_connector_starts(tmp_path):
    from shoal.kv_transfer.shared import SegmentMaker

    ns = temp_folders._pid_namespace()
    stale = [tmp_path / f"shoal-kv-p{_dead_pid()}n{ns}-0a1b2c3d-0{s}" for s in ("", ".1")]
    for f in stale:
        f.write_bytes(b"kv")
    maker = SegmentMaker(tmp_path)
    buf = maker.segment(64)
    assert buf is not None and not any(f.exists() for f in stale)
    assert maker.prefix.startswith(f"shoal-kv-p{os.getpid()}n{ns}-")
    SegmentMaker(tmp_path)  # a second connector keeps the live one's segment
    assert maker.sweep() == 1
