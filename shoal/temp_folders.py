"""Temporary folders (IPC sockets, the API pool's store, multiprocess metrics) and shared
memory files (KV hand-over segments) named after the process that made them, so that a later
shoal process can remove those whose maker died without cleaning up (SIGKILL, the OOM
killer; /tmp and /dev/shm outlive a process).

A folder is `shoal-<kind>-p<pid>n<pid namespace>-<random>` in the system's temp dir. Making
one first sweeps the folders (or files) of that kind whose pid is gone. Only folders of this process's
own pid namespace are swept: /tmp may be shared with a container whose pids mean nothing
here, and removing a live engine's sockets would break it. A pid that was reused keeps its
stale folder (a leak, never harm)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile

logger = logging.getLogger(__name__)

_NAME = re.compile(r"^shoal-(?P<kind>[a-z]+)-p(?P<pid>\d+)n(?P<ns>\d+)-")


def _pid_namespace() -> int:
    """The inode of this process's pid namespace (0 where /proc has none: macOS)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def owner_tag() -> str:
    """`p<pid>n<pid namespace>`: what follows `shoal-<kind>-` in a name sweep_stale judges."""
    return f"p{os.getpid()}n{_pid_namespace()}"


def sweep_stale(kind: str, where: str | None = None) -> list[str]:
    """Removes `kind`'s folders and files in `where` (the temp dir) whose maker is gone;
    returns their paths."""
    where = where or tempfile.gettempdir()
    ns = _pid_namespace()
    removed = []
    try:
        names = os.listdir(where)
    except OSError:
        return removed
    for name in names:
        m = _NAME.match(name)
        if (m is None or m["kind"] != kind or int(m["ns"]) != ns
                or _alive(int(m["pid"]))):
            continue
        path = os.path.join(where, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                os.unlink(path)
            except OSError:
                pass
        if not os.path.lexists(path):
            removed.append(path)
    if removed:
        logger.info("removed %d temporary folder(s) or file(s) of exited shoal processes: %s",
                    len(removed), ", ".join(removed))
    return removed


def make_temp_folder(kind: str, where: str | None = None) -> str:
    """A new private folder for `kind` (lower-case letters), after sweeping its stale ones."""
    if not kind.isalpha() or not kind.islower():
        raise ValueError(f"temp folder kind must be lower-case letters, got {kind!r}")
    sweep_stale(kind, where)
    return tempfile.mkdtemp(prefix=f"shoal-{kind}-{owner_tag()}-", dir=where)
