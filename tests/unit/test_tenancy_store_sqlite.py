"""The SQLite key store: nothing on disk until the first write, a private file, a version per write, keys and
teams as written, a record it cannot trust refused and counted, and a file it cannot use is StoreUnavailable."""

from __future__ import annotations

import sqlite3
import stat

import pytest

from llmgw.tenancy.directory import KeyEntry, TeamEntry, digest_of
from llmgw.tenancy.keys import StoreUnavailable
from llmgw.tenancy.model import Limits
from llmgw.tenancy.store_sqlite import SqliteKeyStore


async def test_keys_and_teams_round_trip_with_a_version_per_write(tmp_path):
    path = tmp_path / "state" / "tenancy.sqlite3"
    store = SqliteKeyStore(path, max_keys=10, max_teams=10)
    assert await store.version() is None and (await store.read()).keys == [] and not path.exists()
    key = KeyEntry("k-0123456789abcdef", "app", digest_of("sk-x"), "ops", frozenset({"m"}), "batch",
                   Limits(rpm=5), "api", 1.5)
    team = TeamEntry("ops", Limits(tpm=100), None, None, "api", 2.0)
    await store.put_team(team)
    await store.put_key(key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    stored = await store.read()
    assert (stored.version, stored.keys, stored.teams, stored.refused) == (2, [key], [team], {})
    await store.delete_key(key.key_id)
    assert await store.version() == 3 and (await store.read()).keys == []
    store.close()
    reopened = SqliteKeyStore(path, max_keys=10, max_teams=10)  # a restart
    assert (await reopened.read()).teams == [team]


async def test_a_record_it_cannot_trust_is_refused_and_the_bounds_hold(tmp_path):
    path = tmp_path / "tenancy.sqlite3"
    store = SqliteKeyStore(path, max_keys=2, max_teams=2)
    for n in range(3):
        await store.put_key(KeyEntry(f"k-000000000000000{n}", f"k{n}", digest_of(f"sk-{n}")))
    with sqlite3.connect(path) as db:
        db.execute("INSERT INTO teams (name, record) VALUES ('bad', ?)", (b'{"name": "bad", "limits": 7}',))
    stored = await store.read()
    assert len(stored.keys) == 2 and stored.teams == [] and stored.refused == {"team": 1}


async def test_a_file_it_cannot_use_is_unavailable(tmp_path):
    path = tmp_path / "tenancy.sqlite3"
    path.write_bytes(b"not a database" * 100)
    with pytest.raises(StoreUnavailable):
        await SqliteKeyStore(path, max_keys=2, max_teams=2).read()
