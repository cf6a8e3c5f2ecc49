"""Run-time LoRA adapters (/v1/load_lora_adapter, /v1/unload_lora_adapter) over the API
processes of `shoal serve --api-server-count N`: an adapter loaded through one process is
served and listed (/v1/models) by all, and one unloaded through any is gone from all.

The adapters are a table of the pool's file, seeded by the supervisor with --lora-modules in
their order (ids 1..k, as each process's ServedModels numbers them at start). The engine knows
an adapter by its id, so the processes must agree on ids: the table hands them out
(AUTOINCREMENT, never reused). Every change bumps the table's version and, inside the same
write transaction, a shared counter cell. Before each request a process compares that cell
with the version of the table it last read and, when they differ, rebuilds its ServedModels'
adapters from the table (AdapterRefresh). The cell moves before the commit lands, so a process
that reads the table early keeps the older version and reads again on its next request: a
request always sees every change committed before it arrived.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence
from typing import Any

from shoal.entrypoints.openai.errors import OpenAIError
from shoal.entrypoints.openai.response_store import connect
from shoal.entrypoints.openai.serving_models import ServedModels
from shoal.lora_request import LoRARequest

_SCHEMA = ["""CREATE TABLE IF NOT EXISTS adapters (
    id INTEGER PRIMARY KEY AUTOINCREMENT,  -- the engine's lora_int_id
    name TEXT NOT NULL UNIQUE,
    path TEXT NOT NULL,
    base TEXT                              -- base_model_name (None: the served model)
)""", "CREATE TABLE IF NOT EXISTS adapters_version (v INTEGER NOT NULL)",
           "INSERT INTO adapters_version SELECT 0 WHERE NOT EXISTS "
           "(SELECT 1 FROM adapters_version)"]


def create_adapter_table(path: str, startup: Sequence[tuple[str, str, str | None]]) -> None:
    """The supervisor's part: the table, holding --lora-modules (name, path, base) as ids
    1..k. A duplicate name is left to the API processes to refuse by name."""
    conn = connect(path)
    try:
        for statement in _SCHEMA:
            conn.execute(statement)
        conn.executemany("INSERT OR IGNORE INTO adapters (name, path, base) VALUES (?, ?, ?)",
                         startup)
    finally:
        conn.close()


class SharedAdapters:
    """One API process's view of the table; `cells[version_cell]` is the shared counter."""

    def __init__(self, path: str, cells: Any, version_cell: int):
        self.path = path
        self.cells = cells
        self.version_cell = version_cell
        self.seen = -1  # the version of the table last read (-1: never)
        self._reader = connect(path)

    def refresh(self, models: ServedModels, force: bool = False) -> None:
        """The table into `models`, if it changed since the last read (or `force`)."""
        if self.cells[self.version_cell] == self.seen and not force:
            return
        conn = self._reader
        conn.execute("BEGIN")  # one snapshot: the version with the rows it goes with
        try:
            version = conn.execute("SELECT v FROM adapters_version").fetchone()[0]
            rows = conn.execute("SELECT name, id, path, base FROM adapters ORDER BY id"
                                ).fetchall()
        finally:
            conn.execute("COMMIT")
        models.loras = {name: LoRARequest(name, lora_id, path, base)
                        for name, lora_id, path, base in rows}
        self.seen = version

    async def load(self, models: ServedModels, name: Any, path: Any,
                   base_model_name: Any) -> LoRARequest:
        """ServedModels.load_lora's checks and answers, then the adapter into the table."""
        self.refresh(models)
        models.load_lora(name, path, base_model_name)  # (its own id is replaced below)
        try:
            await asyncio.to_thread(self._write, "INSERT INTO adapters (name, path, base) "
                                                 "VALUES (?, ?, ?)", (name, path, base_model_name))
        except sqlite3.IntegrityError:  # loaded through another process meanwhile
            models.loras.pop(name, None)
            raise OpenAIError(400, f"The lora adapter '{name}' has already been loaded.",
                              "lora_name") from None
        finally:
            self.refresh(models, force=True)  # (undoes the local change if the write failed)
        return models.loras[name]

    async def unload(self, models: ServedModels, name: Any) -> LoRARequest:
        """ServedModels.unload_lora's checks and answers, then the adapter out of the table."""
        self.refresh(models)
        lora = models.unload_lora(name)
        try:
            gone = await asyncio.to_thread(self._write, "DELETE FROM adapters WHERE id = ?",
                                           (lora.lora_int_id,))
        finally:
            self.refresh(models, force=True)
        if not gone:  # unloaded through another process meanwhile
            raise OpenAIError(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        return lora

    def _write(self, statement: str, args: tuple[Any, ...]) -> int:
        """One change and the version bump, in one transaction; the rows it changed."""
        conn = connect(self.path)  # (its own: several loads may run at once on threads)
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                changed = conn.execute(statement, args).rowcount
                if changed:
                    conn.execute("UPDATE adapters_version SET v = v + 1")
                    version = conn.execute("SELECT v FROM adapters_version").fetchone()[0]
                    self.cells[self.version_cell] = version  # (under the write lock)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            return changed
        finally:
            conn.close()


class AdapterRefresh:
    """Pure ASGI middleware: the table's changes into `models` before each request."""

    def __init__(self, app: Any, adapters: SharedAdapters, models: ServedModels):
        self.app = app
        self.adapters = adapters
        self.models = models

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            self.adapters.refresh(self.models)
        await self.app(scope, receive, send)
