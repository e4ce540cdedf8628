"""Both key stores as two gateways share them (two SQLite stores on one file, two Redis stores on one real
redis-server, each with its own connection): a new key's name and a new team's are claimed atomically with the
write, so of two writers given one name only one has it (NameTaken for the other, nothing written); a revoked or
renamed key gives its name up."""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator

import pytest
import trio

from llmgw.cluster import records
from llmgw.cluster.link import RedisLink
from llmgw.cluster.metrics import ClusterMetrics
from llmgw.cluster.records import Keys
from llmgw.config.loading import parse_config
from llmgw.tenancy.directory import KeyEntry, TeamEntry, digest_of
from llmgw.tenancy.keys import KeyStore, NameTaken
from llmgw.tenancy.model import Limits
from llmgw.tenancy.store_redis import RedisKeyStore
from llmgw.tenancy.store_sqlite import SqliteKeyStore
from llmgw.testing.shared_state import state_section

SECRET = b"s" * 32


@pytest.fixture(params=["sqlite", "redis"])
async def two_stores(request, tmp_path, nursery, redis_url, cluster_name) -> AsyncIterator[list[KeyStore]]:
    """Two stores over one backend, as two gateways (or two workers) hold them."""
    if request.param == "sqlite":
        stores = [SqliteKeyStore(tmp_path / "tenancy.sqlite3", max_keys=10, max_teams=10) for _ in range(2)]
        yield list(stores)
        for store in stores:
            store.close()
        return
    state = parse_config(state_section(redis_url, cluster_name)).state
    redis_stores: list[KeyStore] = []
    for origin in ("a", "b"):
        link = RedisLink(state, ClusterMetrics(None, "gateway", cluster_name, origin))
        await nursery.start(link.run)
        redis_stores.append(RedisKeyStore(link, Keys(cluster_name).prefix, records.Signer(SECRET), max_keys=10,
                                          max_teams=10))
    yield redis_stores


def key(key_id: str, name: str) -> KeyEntry:
    return KeyEntry(key_id, name, digest_of("sk-" + key_id), None, None, None, Limits(rpm=5), "api", 1.0)


async def test_of_two_writers_given_one_new_key_name_at_once_one_has_it(two_stores):
    first, second = two_stores
    outcomes: list[object] = []

    async def create(store: KeyStore, key_id: str) -> None:
        try:
            await store.put_key(key(key_id, "shared"), new=True)
            outcomes.append(key_id)
        except NameTaken as taken:
            outcomes.append(taken)

    async with trio.open_nursery() as both:
        both.start_soon(create, first, "k-000000000000000a")
        both.start_soon(create, second, "k-000000000000000b")
    [winner] = [outcome for outcome in outcomes if isinstance(outcome, str)]
    [taken] = [outcome for outcome in outcomes if isinstance(outcome, NameTaken)]
    assert (taken.kind, taken.owner) == ("key", winner)
    assert [entry.key_id for entry in (await first.read()).keys] == [winner]  # the loser wrote nothing


async def test_a_revoked_or_renamed_key_gives_its_name_up(two_stores):
    first, second = two_stores
    await first.put_key(key("k-000000000000000a", "app"), new=True)
    with pytest.raises(NameTaken):
        await second.put_key(key("k-000000000000000b", "app"), new=True)
    await first.put_key(key("k-000000000000000a", "app-v2"), renamed_from="app")
    await second.put_key(key("k-000000000000000b", "app"), new=True)  # the old name is free
    with pytest.raises(NameTaken):
        await second.put_key(key("k-000000000000000b", "app-v2"), renamed_from="app")  # the new one is not
    await first.delete_key("k-000000000000000a", "app-v2")
    await second.put_key(key("k-000000000000000c", "app-v2"), new=True)
    assert sorted(entry.name for entry in (await first.read()).keys) == ["app", "app-v2"]


async def test_of_two_writers_given_one_new_team_name_one_has_it(two_stores):
    first, second = two_stores
    await first.put_team(TeamEntry("batch", Limits(tpm=100), None, None, "api", 1.0), new=True)
    with pytest.raises(NameTaken) as taken:
        await second.put_team(TeamEntry("batch", Limits(tpm=999), None, None, "api", 2.0), new=True)
    assert (taken.value.kind, taken.value.owner) == ("team", "batch")
    [team] = (await second.read()).teams
    assert team.limits == Limits(tpm=100)  # the first team's, not overwritten
    await second.put_team(TeamEntry("batch", Limits(tpm=200), None, None, "api", 1.0))  # an update: written
    assert (await first.read()).teams[0].limits == Limits(tpm=200)


async def redis_stores(nursery, redis_url: str, cluster_name: str, count: int) -> list[RedisKeyStore]:
    state = parse_config(state_section(redis_url, cluster_name)).state
    stores = []
    for n in range(count):
        link = RedisLink(state, ClusterMetrics(None, "gateway", cluster_name, f"g{n}"))
        await nursery.start(link.run)
        stores.append(RedisKeyStore(link, Keys(cluster_name).prefix, records.Signer(SECRET), max_keys=10,
                                    max_teams=10))
    return stores


async def test_a_revoked_key_or_deleted_team_put_back_by_a_redis_writer_stays_gone(nursery, redis_url, cluster_name):
    store, later = await redis_stores(nursery, redis_url, cluster_name, 2)
    prefix = Keys(cluster_name).prefix + "tenancy:"
    await store.put_team(TeamEntry("batch", Limits(tpm=100), None, None, "api", 1.0), new=True)
    await store.put_key(key("k-000000000000000a", "app"), new=True)
    assert [entry.key_id for entry in (await store.read()).keys] == ["k-000000000000000a"]
    copied_key = await store.link.call("t", lambda client: client.hget(prefix + "keys", "k-000000000000000a"))
    copied_team = await store.link.call("t", lambda client: client.hget(prefix + "teams", "batch"))
    await store.delete_key("k-000000000000000a", "app")
    await store.delete_team("batch")
    await store.read()
    await store.link.call("t", lambda client: client.hset(prefix + "keys", {"k-000000000000000a": copied_key}))
    await store.link.call("t", lambda client: client.hset(prefix + "teams", {"batch": copied_team}))
    replayed = await store.read()
    assert (replayed.keys, replayed.teams) == ([], [])
    assert replayed.refused == {"replayed_key": 1, "replayed_team": 1}
    fresh = await later.read()  # a gateway that never saw the key: the tombstones in the store refuse it
    assert (fresh.keys, fresh.teams, fresh.refused) == ([], [], {"replayed_key": 1, "replayed_team": 1})
    # the writer removes the tombstones too: the gateway that saw them still refuses the old records
    await store.link.call("t", lambda client: client.delete([prefix + "revoked"]))
    assert (await store.read()).refused == {"replayed_key": 1, "replayed_team": 1}
    # once the replayed record is cleared, a team of the same name made again is a new revision, above the old
    await store.link.call("t", lambda client: client.hdel(prefix + "teams", ["batch"]))
    await later.put_team(TeamEntry("batch", Limits(tpm=5), None, None, "api", 3.0), new=True)
    assert [team.limits for team in (await store.read()).teams] == [Limits(tpm=5)]


async def test_an_older_record_of_a_key_is_refused_once_a_newer_was_seen(nursery, redis_url, cluster_name):
    [store] = await redis_stores(nursery, redis_url, cluster_name, 1)
    prefix = Keys(cluster_name).prefix + "tenancy:"
    await store.put_key(key("k-000000000000000a", "app"), new=True)
    looser = await store.link.call("t", lambda client: client.hget(prefix + "keys", "k-000000000000000a"))
    tighter = dataclasses.replace(key("k-000000000000000a", "app"), limits=Limits(rpm=1))
    await store.put_key(tighter)
    assert (await store.read()).keys == [tighter]
    await store.link.call("t", lambda client: client.hset(prefix + "keys", {"k-000000000000000a": looser}))
    stored = await store.read()
    assert stored.keys == [] and stored.refused == {"replayed_key": 1}


async def test_a_revision_counter_a_writer_set_back_only_makes_a_write_take_a_higher_one(nursery, redis_url,
                                                                                         cluster_name):
    first, fresh = await redis_stores(nursery, redis_url, cluster_name, 2)
    prefix = Keys(cluster_name).prefix + "tenancy:"
    for rpm in (1, 2, 3):
        await first.put_key(dataclasses.replace(key("k-000000000000000a", "app"), limits=Limits(rpm=rpm)),
                            new=rpm == 1)
    await fresh.link.call("t", lambda client: client.set(prefix + "revision", "0"))
    updated = dataclasses.replace(key("k-000000000000000a", "app"), limits=Limits(rpm=4))
    await fresh.put_key(updated)  # its first revision is stale: it is told so, and takes one above
    assert (await first.read()).keys == [updated] and (await fresh.read()).keys == [updated]


async def test_records_of_the_previous_secret_are_re_signed_unless_changed_since_they_were_read(
        nursery, redis_url, cluster_name):
    """A rotation of the cluster secret (docs/runbook.md): what the old secret signed is admitted by a store that
    has it as its previous one, and re-signed with the current one; a record changed between the read and the
    re-signing keeps the change."""
    (old,) = await redis_stores(nursery, redis_url, cluster_name, 1)
    await old.put_key(key("k-000000000000000a", "app"), new=True)
    await old.put_key(key("k-000000000000000b", "etl"), new=True)
    await old.put_team(TeamEntry("batch", Limits(rpm=5)), new=True)
    new = RedisKeyStore(old.link, Keys(cluster_name).prefix, records.Signer(b"n" * 32, SECRET), max_keys=10,
                        max_teams=10)
    stored = await new.read()
    assert len(stored.keys) == 2 and len(stored.teams) == 1 and len(stored.resign) == 3 and not stored.refused
    await old.put_key(dataclasses.replace(key("k-000000000000000b", "etl"), limits=Limits(rpm=9)))  # meanwhile
    assert await new.resign(stored.resign) == 2
    after = await new.read()
    assert {entry.key_id for entry in after.keys} == {"k-000000000000000a", "k-000000000000000b"}
    assert [field for _, field, *_ in after.resign] == ["k-000000000000000b"]  # changed: the old secret's still
    assert {entry.key_id: entry.limits.rpm for entry in after.keys}["k-000000000000000b"] == 9  # not overwritten
    dropped = RedisKeyStore(old.link, Keys(cluster_name).prefix, records.Signer(b"n" * 32), max_keys=10,
                            max_teams=10)
    assert {entry.key_id for entry in (await dropped.read()).keys} == {"k-000000000000000a"}
    assert (await dropped.read()).teams  # the team was re-signed too
