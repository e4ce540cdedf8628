"""Where usage rows are kept, applied exactly once: the store's interface, its batches, and the SQLite store.

A :class:`Batch` is the rows one flush ships, named by where they came from: a journal segment and the byte
offset it ends at (or, without a journal, the process's id and a batch number). A store applies a batch with
its marker (the journal's name and offset) in one transaction (SQLite) or script (Redis); a batch whose offset
the store's marker for its journal has reached is not applied again. A flush whose answer was lost is therefore
retried as it was, and counts once. The flusher keeps batches to :data:`MAX_BATCH_ROWS` rows.

:class:`SqliteUsageStore` is ``state.backend: local``'s: a table of hourly rows in the SQLite file of the state
dir, written in a worker thread (one at a time); rows of hours older than :data:`RETENTION_SECONDS` are deleted
(at most once an hour, in a flush's transaction).
"""

from __future__ import annotations

import logging
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, TypeVar

import trio

from .interfaces import StoreUnavailable
from .sqlite_file import open_private_database
from .usage import FIELDS, Counts, UsageRow

log = logging.getLogger(__name__)

MAX_BATCH_ROWS = 20_000  # rows one transaction or script applies (a Redis script of up to ~240k HINCRBYs)
MARKER_SECONDS = 30 * 86400  # how long a store remembers a journal's shipped position
RETENTION_SECONDS = 400 * 86400  # how long a store keeps an hour's rows after the hour (Redis: after its last write)
PRUNE_EVERY = 3600.0  # SQLite: seconds between two deletions of rows past the retention
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Batch:
    journal: str  # a journal segment's name, or "process-<id>" without a journal
    offset: int  # where the batch ends in it (bytes, or the batch's number): every batch of it ends further
    rows: dict[UsageRow, Counts]


class UsageStore(Protocol):
    async def apply(self, batch: Batch) -> bool:
        """Add ``batch``'s rows unless its journal's marker reached its offset (then False), and move the marker
        in the same step; :class:`StoreUnavailable` when the store cannot be reached."""

    async def shipped(self, journal: str) -> int | None:
        """The offset of the last batch applied from ``journal``, or None."""

    async def rows(self, since: int, until: int) -> list[tuple[UsageRow, Counts]]:
        """Every hourly row of the hours from ``since`` to ``until`` (exclusive)."""


_COLUMNS = ", ".join(FIELDS)
_IDENTITY = "hour, key_id, key_name, team, model, priority"


def _table(name: str) -> str:
    return f"""CREATE TABLE IF NOT EXISTS {name} (
    hour INTEGER NOT NULL, key_id TEXT NOT NULL, key_name TEXT NOT NULL, team TEXT NOT NULL, model TEXT NOT NULL,
    priority TEXT NOT NULL DEFAULT '',
    {", ".join(f"{field} INTEGER NOT NULL DEFAULT 0" for field in FIELDS)},
    PRIMARY KEY ({_IDENTITY}));
"""


_SCHEMA = _table("usage_hourly") + """
CREATE TABLE IF NOT EXISTS usage_shipped (
    journal TEXT PRIMARY KEY, offset INTEGER NOT NULL, at REAL NOT NULL);
"""
_UPSERT = (f"INSERT INTO usage_hourly ({_IDENTITY}, {_COLUMNS}) "
           f"VALUES (?, ?, ?, ?, ?, ?, {', '.join('?' for _ in FIELDS)}) "
           f"ON CONFLICT ({_IDENTITY}) DO UPDATE SET "
           + ", ".join(f"{field} = {field} + excluded.{field}" for field in FIELDS))


def migrate(db: sqlite3.Connection, path: Path) -> None:
    """Give a file written before priority classes its ``priority`` column, in its rows' key: the table is
    rebuilt once (its rows kept, of no class) in one transaction; a file already migrated is left as it is."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(usage_hourly)")}
    if "priority" in columns:
        return
    db.execute("BEGIN IMMEDIATE")
    try:
        db.execute(_table("usage_hourly_classed"))
        db.execute(f"INSERT INTO usage_hourly_classed ({_IDENTITY}, {_COLUMNS}) "
                   f"SELECT hour, key_id, key_name, team, model, '', {_COLUMNS} FROM usage_hourly")
        db.execute("DROP TABLE usage_hourly")
        db.execute("ALTER TABLE usage_hourly_classed RENAME TO usage_hourly")
        kept = db.execute("SELECT COUNT(*) FROM usage_hourly").fetchone()[0]
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    log.warning("usage store %s: table usage_hourly migrated to count usage per priority class (%d rows kept, of "
                "no class); a gateway of an older version can no longer write to this file", path, kept)


class SqliteUsageStore:
    """Hourly usage rows in a SQLite file (``state.backend: local``); one worker thread at a time."""

    def __init__(self, path: Path, clock: Callable[[], float] = time.time, retention: int = RETENTION_SECONDS):
        self.path = path
        self._clock = clock
        self.retention = retention
        self._pruned = float("-inf")
        self._limiter = trio.CapacityLimiter(1)
        self._db: sqlite3.Connection | None = None

    async def _run(self, work: Callable[[sqlite3.Connection], T]) -> T:
        try:
            return await trio.to_thread.run_sync(self._in_thread, work, limiter=self._limiter)
        except (sqlite3.Error, OSError) as exc:
            raise StoreUnavailable(f"{self.path}: {exc}") from exc

    def _in_thread(self, work: Callable[[sqlite3.Connection], T]) -> T:
        if self._db is None:
            db = open_private_database(self.path, _SCHEMA, busy_timeout=10.0)
            migrate(db, self.path)
            self._db = db
        return work(self._db)

    async def apply(self, batch: Batch) -> bool:
        def work(db: sqlite3.Connection) -> bool:
            db.execute("BEGIN IMMEDIATE")
            try:
                done = db.execute("SELECT offset FROM usage_shipped WHERE journal = ?", (batch.journal,)).fetchone()
                if done is not None and done[0] >= batch.offset:
                    db.execute("ROLLBACK")
                    return False
                db.executemany(_UPSERT, [(row.hour, row.key_id, row.key_name, row.team, row.model, row.priority,
                                          *counts)
                                         for row, counts in batch.rows.items()])
                now = self._clock()
                db.execute("INSERT INTO usage_shipped (journal, offset, at) VALUES (?, ?, ?) "
                           "ON CONFLICT (journal) DO UPDATE SET offset = excluded.offset, at = excluded.at",
                           (batch.journal, batch.offset, now))
                if now - self._pruned >= PRUNE_EVERY:
                    self._pruned = now
                    db.execute("DELETE FROM usage_shipped WHERE at < ?", (now - MARKER_SECONDS,))
                    db.execute("DELETE FROM usage_hourly WHERE hour < ?", (now - self.retention,))
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            return True

        return await self._run(work)

    async def shipped(self, journal: str) -> int | None:
        def work(db: sqlite3.Connection) -> int | None:
            done = db.execute("SELECT offset FROM usage_shipped WHERE journal = ?", (journal,)).fetchone()
            return None if done is None else int(done[0])

        return await self._run(work)

    async def rows(self, since: int, until: int) -> list[tuple[UsageRow, Counts]]:
        def work(db: sqlite3.Connection) -> list[tuple[UsageRow, Counts]]:
            found = db.execute(f"SELECT {_IDENTITY}, {_COLUMNS} FROM usage_hourly "
                               "WHERE hour >= ? AND hour < ?", (since, until))
            return [(UsageRow(key_id, key_name, team, model, hour, priority), list(counts))
                    for hour, key_id, key_name, team, model, priority, *counts in found]

        return await self._run(work)

    async def close(self) -> None:
        def work(db: sqlite3.Connection) -> None:
            db.close()

        if self._db is not None:
            await self._run(work)
            self._db = None

