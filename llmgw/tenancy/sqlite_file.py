"""The tenancy store's SQLite file, opened the one way both its users need: keys and teams
(:mod:`.store_sqlite`) and usage (:mod:`.usage_store`) share the file (``tenancy.store``), so whichever opens it
first makes it private to its owner (folder 0700, file 0600: it holds the keys' hashes and who used what) and in
WAL mode (readers never wait on a write)."""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path


def open_private_database(path: Path, schema: str, busy_timeout: float) -> sqlite3.Connection:
    """A connection to ``path`` (created 0600 in a 0700 folder when missing) with ``schema`` applied, for use
    from a worker thread (``check_same_thread=False``) in autocommit mode (transactions are explicit)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not path.exists():
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    connection = sqlite3.connect(path, timeout=busy_timeout, check_same_thread=False, isolation_level=None)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.executescript(schema)
    return connection
