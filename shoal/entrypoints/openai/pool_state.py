"""What the API processes of `shoal serve --api-server-count N` share besides the engine, so
that a client sees one server whichever process its request lands on:

- counters in shared memory (int64 cells): each API process's requests in flight, whose sum
  GET /load answers (pool_load.py), and the version of the LoRA adapter table;
- a folder of the supervisor's with one SQLite file: the Responses API store
  (response_store.py) and the adapters loaded at run time (pool_adapters.py).

The supervisor creates it (PoolShared.create) before it spawns the API processes, which get it
pickled at spawn (the only time shared memory can travel), and removes the folder at exit.
Each API process joins it once, before its app is built; the parts that behave differently in
a pool ask member(), which is None in a one-process server: that one keeps its in-process
state and takes no extra step.
"""

from __future__ import annotations

import multiprocessing
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shoal.entrypoints.openai.pool_adapters import create_adapter_table
from shoal.entrypoints.openai.response_store import create_store_file
from shoal.entrypoints.openai.server_settings import ServerSettings
from shoal.temp_folders import make_temp_folder

POOL_FILE = "pool.sqlite"


@dataclass(frozen=True)
class PoolShared:
    folder: str  # the supervisor's temporary folder
    cells: Any  # RawArray of int64: cell k < N is API process k's requests in flight, cell N
    #             the adapter table's version
    load_tracking: bool  # --enable-server-load-tracking
    root_path: str  # --root-path ("" without one)

    @classmethod
    def create(cls, settings: ServerSettings,
               adapters: Sequence[tuple[str, str, str | None]] = ()) -> PoolShared:
        """`adapters`: --lora-modules as (name, path, base model name), in their order."""
        folder = make_temp_folder("pool")
        try:
            path = os.path.join(folder, POOL_FILE)
            create_store_file(path)
            create_adapter_table(path, adapters)
            cells = multiprocessing.get_context("spawn").RawArray(
                "q", settings.api_server_count + 1)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        return cls(folder, cells, settings.enable_server_load_tracking, settings.root_path or "")

    @property
    def file(self) -> str:
        """The SQLite file of the Responses store and the adapter table."""
        return os.path.join(self.folder, POOL_FILE)

    @property
    def adapters_cell(self) -> int:
        return len(self.cells) - 1

    def requests_in_flight(self) -> int:
        return sum(self.cells[:self.adapters_cell])

    def process_gone(self, index: int) -> None:
        """API process `index` has exited: its requests went with it (only its own process
        writes its cell, and the supervisor starts the next one on `index` after this call,
        so nothing races it)."""
        self.cells[index] = 0

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass(frozen=True)
class Member:
    """This process is API process `index` of the pool that shares `shared`."""

    shared: PoolShared
    index: int


_member: Member | None = None


def join(shared: PoolShared, index: int) -> None:
    """Called once by an API process at start (api_server_pool.run_api_process)."""
    global _member
    _member = Member(shared, index)


def member() -> Member | None:
    """This process's place in a pool; None in a one-process server."""
    return _member
