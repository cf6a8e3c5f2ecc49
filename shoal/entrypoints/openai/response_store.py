"""Where the Responses API keeps stored responses (`store: true`) and their conversations, for
GET /v1/responses/{id} and `previous_response_id`: the newest --max-stored-responses of them,
the oldest dropped by the write that goes over.

One API process: a dict in its memory (ResponseStore). Several (`--api-server-count N`): one
SQLite file that every API process reads and writes (SharedResponseStore), since a client's
next request may land on another process. The supervisor creates the file
(create_store_file) in a temporary folder of its own before the API processes start and
removes the folder at exit: nothing in it outlives the server. WAL mode: a reader never waits
for a writer, so lookups run on the event loop; writers wait for each other (SQLite's file
lock, which the kernel releases if a process dies), so writes run on a thread of their own and
never hold up the loop. A write commits before its response is sent: the client's next
request finds it wherever it lands."""

from __future__ import annotations

import asyncio
import sqlite3
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from shoal.entrypoints.openai.errors import OpenAIError

BUSY_TIMEOUT_S = 30.0  # how long a write waits for another process's (each is milliseconds)
_SCHEMA = """CREATE TABLE IF NOT EXISTS responses (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,  -- insertion order: the oldest goes first
    id TEXT NOT NULL UNIQUE,
    body BLOB NOT NULL,                     -- the Response object (JSON)
    conversation BLOB NOT NULL              -- its messages, for previous_response_id (JSON)
)"""
_TRIM = ("DELETE FROM responses WHERE seq <= "
         "(SELECT seq FROM responses ORDER BY seq DESC LIMIT 1 OFFSET ?)")

Entry = tuple[dict[str, Any], list[dict[str, Any]]]


def check_response_id(response_id: str, param: str | None) -> None:
    """A malformed id is a 400, as OpenAI and vLLM answer."""
    if not response_id.startswith("resp"):
        raise OpenAIError(400, f"Invalid '{param or 'response_id'}': {response_id!r}. "
                               "Expected an ID that begins with 'resp'.", param)


def not_stored(response_id: str, capacity: int, param: str | None) -> OpenAIError:
    return OpenAIError(404, f"no stored response {response_id!r} (the server keeps the last "
                            f"{capacity} of them)", param)


def connect(path: str) -> sqlite3.Connection:
    """A connection to the pool's file (pool_adapters.py uses it too)."""
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                           check_same_thread=False)
    # The file dies with the server: an OS crash losing the last writes is harmless.
    conn.execute("PRAGMA synchronous=OFF")
    return conn


def create_store_file(path: str) -> None:
    """The supervisor's part: the table, in WAL mode (a property of the file), before any API
    process opens it."""
    conn = connect(path)
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(_SCHEMA)
    finally:
        conn.close()


class ResponseStore:
    """One process's store: the last `capacity` responses (0 keeps none)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict[str, Entry] = OrderedDict()

    def get(self, response_id: str, param: str | None = None) -> Entry:
        check_response_id(response_id, param)
        entry = self._items.get(response_id)
        if entry is None:
            raise not_stored(response_id, self.capacity, param)
        return entry

    async def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if self.capacity <= 0:
            return
        self._items[response["id"]] = (response, conversation)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)


class SharedResponseStore:
    """ResponseStore's interface over the shared file: get() on the caller's thread, put() on
    the store's writer thread."""

    def __init__(self, path: str, capacity: int):
        if capacity <= 0:
            raise ValueError(f"capacity must be >= 1 (got {capacity}); 0 stores nothing")
        self.capacity = capacity
        self._reader = connect(path)
        self._writer = connect(path)  # used by the one writer thread alone
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="shoal-response-store")
        self._encode = msgspec.json.Encoder().encode

    def get(self, response_id: str, param: str | None = None) -> Entry:
        check_response_id(response_id, param)
        row = self._reader.execute("SELECT body, conversation FROM responses WHERE id = ?",
                                   (response_id,)).fetchone()
        if row is None:
            raise not_stored(response_id, self.capacity, param)
        return msgspec.json.decode(row[0]), msgspec.json.decode(row[1])

    async def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        row = (response["id"], self._encode(response), self._encode(conversation))
        await asyncio.get_running_loop().run_in_executor(self._thread, self._write, row)

    def _write(self, row: tuple[str, bytes, bytes]) -> None:
        conn = self._writer
        conn.execute("BEGIN IMMEDIATE")  # the write lock now: no upgrade deadlock later
        try:
            conn.execute("INSERT OR REPLACE INTO responses (id, body, conversation) "
                         "VALUES (?, ?, ?)", row)
            conn.execute(_TRIM, (self.capacity,))
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self._reader.close()
        self._writer.close()
