"""Crash safety of the disk KV tier (issue 18, item 7): a process killed (SIGKILL) in the
middle of writing a block, and a disk that fills up, leave nothing that a restart reads as
valid, and the restarted engine serves the same tokens. Also: blocks left in the CPU tier
reach the disk at a real interpreter exit (review finding 4)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tier_fixtures import _disk, _h, _payload

import shoal.kv_offload.disk_format as fmt
from shoal import LLM, SamplingParams
from shoal.kv_offload.control import persist
from shoal.kv_offload.disk_format import SUFFIX, TMP_MARK
from shoal.kv_offload.tier import ReadOutcome

HERE = Path(__file__).parent
BLOCK = 4
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 16 * 4  # the tiny checkpoint's block, fp32
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
P = {"prompt_token_ids": [(i * 37 + 11) % 500 + 3 for i in range(50)]}  # 12 full blocks


def engine_with_disk(model_dir, root) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", block_size=BLOCK, max_model_len=256,
               num_gpu_blocks_override=24, kv_offloading_size=64 * BLOCK_BYTES / 2**30,
               kv_offloading_disk_path=str(root),
               kv_offloading_disk_size=256 * (BLOCK_BYTES + 64) / 2**30)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[int]:
    # 24 blocks as the engines under test (the default 4 GiB pool: 2M blocks, ~3 s to build)
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", block_size=BLOCK, max_model_len=256,
              num_gpu_blocks_override=24, enable_prefix_caching=False)
    return llm.generate(P, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _child(*args: str, wait_for: str | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), str(HERE.parent)])}
    proc = subprocess.Popen([sys.executable, str(HERE / "disk_crash_child.py"), *args],
                            stdout=subprocess.PIPE, text=True, env=env)
    if wait_for is not None:
        assert proc.stdout is not None
        for line in proc.stdout:  # blocks until the child is where the test wants it
            if line.strip() == wait_for:
                return proc
        raise AssertionError(f"the child exited ({proc.wait()}) before {wait_for}")
    return proc


def _kill_mid_write(*args: str) -> None:
    proc = _child(*args, wait_for="MID-WRITE")
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(30) == -signal.SIGKILL


def _files(root: Path) -> tuple[list[Path], list[Path]]:
    """(block files, temporary files) under root."""
    every = [p for p in root.rglob("*") if p.is_file()]
    return ([p for p in every if p.name.endswith(SUFFIX)],
            [p for p in every if TMP_MARK in p.name])


def _all_valid(disk) -> None:
    """Every block the tier lists reads back verified, with the payload it was stored with."""
    for h in disk.keys():
        dst = torch.empty_like(_payload(0)[0])
        assert disk.read_into(h, dst)[0] is ReadOutcome.OK
        assert torch.equal(dst, _payload(int.from_bytes(h, "little"))[0])
    disk.check()


def test_sigkill_in_the_middle_of_a_block_write(tmp_path):
    _kill_mid_write("tier", str(tmp_path), "5")
    blocks, temps = _files(tmp_path)
    assert len(blocks) == 5 and len(temps) == 1  # the half-written file has no real name
    disk = _disk(tmp_path, 64)  # a restart
    assert sorted(disk.keys()) == [_h(i) for i in range(5)]
    assert _files(tmp_path)[1] == []  # the leftover is deleted at start-up
    _all_valid(disk)


@contextlib.contextmanager
def _small_disk(root: Path, nbytes: int, monkeypatch):
    """A folder on a file system of nbytes: a tmpfs where one can be mounted (root), else a
    write hook that fails with ENOSPC once the folder's files would pass nbytes."""
    root.mkdir()
    mounted = os.geteuid() == 0 and shutil.which("mount") is not None and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={nbytes}", "tmpfs", str(root)],
        capture_output=True).returncode == 0
    if not mounted:
        real = fmt._writev_full

        def writev(fd: int, bufs: list) -> None:
            used = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
            room = nbytes - used
            need = sum(memoryview(b).nbytes for b in bufs)
            if need > room:
                os.write(fd, b"".join(bytes(b) for b in bufs)[:max(0, room)])
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            real(fd, bufs)

        monkeypatch.setattr(fmt, "_writev_full", writev)
    try:
        yield
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(root)], check=False)


def test_a_full_disk_fails_writes_cleanly(tmp_path, monkeypatch):
    root = tmp_path / "small"
    with _small_disk(root, 32 * 1024, monkeypatch):
        disk = _disk(root, 64, background=True)  # configured far beyond the real room
        for i in range(64):
            assert disk.store([_h(i)], _payload(i)) == 1
        disk.drain()
        assert 0 < disk.writer.failed_writes < 64
        blocks, temps = _files(root)
        assert temps == [] and len(blocks) == len(disk) == 64 - disk.writer.failed_writes
        _all_valid(disk)  # failed writes left the index
        disk.close()
        again = _disk(root, 64)
        assert sorted(again.keys()) == sorted(disk.keys())
        _all_valid(again)


def _restart_serves(model_dir, root, reference) -> tuple[int, list]:
    llm = engine_with_disk(model_dir, root)
    out = llm.generate(P, GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference
    return out.num_cached_tokens, _files(Path(root))[1]


def test_engine_killed_while_persisting_restarts_with_the_same_tokens(tiny_llama_dir, tmp_path,
                                                                     reference):
    _kill_mid_write("engine", str(tmp_path), "3", str(tiny_llama_dir))
    blocks, temps = _files(tmp_path)
    assert len(blocks) == 3 and len(temps) == 1
    cached, temps = _restart_serves(tiny_llama_dir, tmp_path, reference)
    assert temps == [] and cached <= 48


def test_engine_on_a_full_disk_restarts_with_the_same_tokens(tiny_llama_dir, tmp_path,
                                                            monkeypatch, reference):
    root = tmp_path / "small"
    with _small_disk(root, 24 * 1024, monkeypatch):
        llm = engine_with_disk(tiny_llama_dir, root)
        assert llm.generate(P, GREEDY, use_tqdm=False)[0].outputs[0].token_ids == reference
        persist(llm.llm_engine.core)
        llm.llm_engine.shutdown()
        disk = llm.llm_engine.core.kv_offload.tier("disk")
        assert disk.writer.failed_writes > 0
        _, temps = _restart_serves(tiny_llama_dir, root, reference)
        assert temps == []


def test_cpu_tier_reaches_the_disk_when_dropped_or_at_interpreter_exit(tiny_llama_dir,
                                                                        tmp_path, reference):
    proc = _child("atexit", str(tmp_path), "-1", str(tiny_llama_dir))
    assert proc.wait(120) == 0
    for sub in ("dropped", "alive"):
        cached, _ = _restart_serves(tiny_llama_dir, tmp_path / sub, reference)
        assert cached == 48  # every full block but the last token's, from the disk
