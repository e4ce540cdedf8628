"""The key store of ``state.backend: local``: API keys and teams in a SQLite file in the state dir.

One table per kind (id -> the JSON record of :mod:`.codec`), the key names claimed (name -> key id) and a
version that every write increments in the same transaction, which also claims a new name (``BEGIN
IMMEDIATE``: one writer at a time over every process sharing the file), as :mod:`.store_redis` does. Every
call runs in a worker thread (``trio.to_thread``) one at a time, on one connection.
The file is created (mode 0600, its directory 0700) by the first write; until then the store is empty. It
survives a restart; several processes on one machine may share it (SQLite locks it per transaction).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import trio

from ..config import Config
from ..control.identity import default_control_state_dir
from . import codec
from .directory import KeyEntry, TeamEntry
from .keys import NameTaken, Stored, StoreUnavailable
from .sqlite_file import open_private_database

log = logging.getLogger(__name__)
T = TypeVar("T")
FILE_NAME = "tenancy.sqlite3"
BUSY_TIMEOUT = 5.0  # seconds a write waits for another process's transaction on the file
SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (id TEXT PRIMARY KEY, record BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS teams (name TEXT PRIMARY KEY, record BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS key_names (name TEXT PRIMARY KEY, id TEXT NOT NULL);
"""


def store_path(config: Config) -> Path:
    """The SQLite file of ``state.backend: local``: ``tenancy.store``, by default beside the control plane's node
    identities (``agents.control_state_dir``)."""
    if config.tenancy.store:
        return Path(config.tenancy.store).expanduser()
    return Path(config.agents.control_state_dir or default_control_state_dir()).expanduser() / FILE_NAME


class SqliteKeyStore:
    def __init__(self, path: Path, *, max_keys: int, max_teams: int):
        self.path = path
        self.max_keys = max_keys
        self.max_teams = max_teams
        self._connection: sqlite3.Connection | None = None
        self._limiter = trio.CapacityLimiter(1)  # one connection, one call at a time

    async def version(self) -> object:
        return await self._run(self._version)

    async def read(self) -> Stored:
        return await self._run(self._read)

    async def resign(self, records_read: list[Any]) -> int:
        return 0  # nothing here is signed: Stored.resign is always empty

    async def put_key(self, entry: KeyEntry, *, new: bool = False, renamed_from: str | None = None) -> None:
        def write(connection: sqlite3.Connection) -> None:
            if new or renamed_from is not None:
                _claim(connection, entry.name, entry.key_id)
            if renamed_from is not None:
                _release(connection, renamed_from, entry.key_id)
            connection.execute("INSERT OR REPLACE INTO keys (id, record) VALUES (?, ?)",
                                (entry.key_id, codec.encode_key(entry)))

        await self._run(lambda: self._write(write))

    async def delete_key(self, key_id: str, name: str | None = None) -> None:
        def write(connection: sqlite3.Connection) -> None:
            connection.execute("DELETE FROM keys WHERE id = ?", (key_id,))
            if name is not None:
                _release(connection, name, key_id)

        await self._run(lambda: self._write(write))

    async def put_team(self, entry: TeamEntry, *, new: bool = False) -> None:
        def write(connection: sqlite3.Connection) -> None:
            if new and connection.execute("SELECT 1 FROM teams WHERE name = ?", (entry.name,)).fetchone():
                raise NameTaken("team", entry.name)
            connection.execute("INSERT OR REPLACE INTO teams (name, record) VALUES (?, ?)",
                               (entry.name, codec.encode_team(entry)))

        await self._run(lambda: self._write(write))

    async def delete_team(self, name: str) -> None:
        await self._run(lambda: self._write(
            lambda connection: connection.execute("DELETE FROM teams WHERE name = ?", (name,))))

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    # -- in the worker thread ------------------------------------------------------------------------------------

    async def _run(self, call: Callable[[], T]) -> T:
        try:
            return await trio.to_thread.run_sync(call, limiter=self._limiter)
        except (sqlite3.Error, OSError) as exc:
            raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from None

    def _connect(self, create: bool) -> sqlite3.Connection | None:
        if self._connection is None:
            if not create and not self.path.exists():
                return None
            self._connection = open_private_database(self.path, SCHEMA, BUSY_TIMEOUT)
        return self._connection

    def _version(self) -> object:
        connection = self._connect(create=False)
        if connection is None:
            return None
        row = connection.execute("SELECT value FROM meta WHERE name = 'version'").fetchone()
        return row[0] if row else 0

    def _read(self) -> Stored:
        connection = self._connect(create=False)
        if connection is None:
            return Stored(None, [], [])
        connection.execute("BEGIN")
        try:
            version = self._version()
            keys_raw = connection.execute("SELECT record FROM keys LIMIT ?", (self.max_keys,)).fetchall()
            teams_raw = connection.execute("SELECT record FROM teams LIMIT ?", (self.max_teams,)).fetchall()
        finally:
            connection.execute("COMMIT")
        refused: dict[str, int] = {}
        keys = _decoded(keys_raw, codec.decode_key, "key", refused)
        teams = _decoded(teams_raw, codec.decode_team, "team", refused)
        return Stored(version, keys, teams, refused)

    def _write(self, change: Callable[[sqlite3.Connection], object]) -> None:
        connection = self._connect(create=True)
        assert connection is not None
        connection.execute("BEGIN IMMEDIATE")
        try:
            change(connection)
            connection.execute("INSERT INTO meta (name, value) VALUES ('version', 1) "
                               "ON CONFLICT (name) DO UPDATE SET value = value + 1")
        except BaseException:
            connection.execute("ROLLBACK")
            raise
        connection.execute("COMMIT")


def _claim(connection: sqlite3.Connection, name: str, key_id: str) -> None:
    """Claim ``name`` for ``key_id``, unless another key that still exists holds it (:class:`NameTaken`)."""
    row = connection.execute("SELECT id FROM key_names WHERE name = ?", (name,)).fetchone()
    if row and row[0] != key_id and connection.execute("SELECT 1 FROM keys WHERE id = ?", (row[0],)).fetchone():
        raise NameTaken("key", row[0])
    connection.execute("INSERT OR REPLACE INTO key_names (name, id) VALUES (?, ?)", (name, key_id))


def _release(connection: sqlite3.Connection, name: str, key_id: str) -> None:
    connection.execute("DELETE FROM key_names WHERE name = ? AND id = ?", (name, key_id))


def _decoded(rows: list[tuple[bytes]], decode: Callable[[bytes], T], kind: str, refused: dict[str, int]) -> list[T]:
    entries = []
    for (raw,) in rows:
        try:
            entries.append(decode(bytes(raw)))
        except codec.RecordError as exc:
            refused[kind] = refused.get(kind, 0) + 1
            log.debug("key store: a %s record is refused: %s", kind, exc)
    return entries
