"""Usage reaches the SQLite store exactly once: lost answers, a store away, memory bounds, the journal's replay."""

from __future__ import annotations

import os
import sqlite3
import stat

import pytest
import trio
from hypothesis import given, settings, strategies as st

from llmgw.tenancy.interfaces import RATE_LIMITED, UsageRecord
from llmgw.tenancy.model import Team, TenancySettings, Tenant, Usage
from llmgw.tenancy.usage import FIELDS, UsageAggregator, UsageRow
from llmgw.tenancy.usage_flush import UsageFlusher
from llmgw.tenancy.usage_journal import UsageJournal, decode, encode, read_rows
from llmgw.tenancy.usage_redis import parse_field, row_field
from llmgw.tenancy.usage_service import budget_spent
from llmgw.tenancy.usage_store import Batch, SqliteUsageStore, StoreUnavailable

HOUR = 1_796_000_400
REQUESTS, INPUT, NANO = FIELDS.index("requests"), FIELDS.index("input_tokens"), FIELDS.index("nano_usd")


def answer(key: str, *, at: float = HOUR + 5, prompt: int = 10, nano: int = 7, team: str | None = "t"):
    return UsageRecord(f"k-{key}", key, team, "tiny", Usage(prompt, 3, 0, nano), 200, at)


async def totals(store: SqliteUsageStore) -> dict[str, tuple[int, int, int]]:
    """Requests, input tokens and nano-dollars per key name."""
    found: dict[str, tuple[int, int, int]] = {}
    for row, counts in await store.rows(0, 2**40):
        old = found.get(row.key_name, (0, 0, 0))
        found[row.key_name] = (old[0] + counts[REQUESTS], old[1] + counts[INPUT], old[2] + counts[NANO])
    return found


class FlakyStore:
    """A SQLite store that refuses while ``down``, and can lose the answer of an apply that went through."""

    def __init__(self, store: SqliteUsageStore):
        self.store = store
        self.down = False
        self.lose_answers = 0
        self.applied = 0

    async def apply(self, batch: Batch) -> bool:
        if self.down:
            raise StoreUnavailable("down")
        done = await self.store.apply(batch)
        self.applied += 1
        if self.lose_answers:
            self.lose_answers -= 1
            raise StoreUnavailable("the answer was lost")
        return done

    async def shipped(self, journal: str) -> int | None:
        if self.down:
            raise StoreUnavailable("down")
        return await self.store.shipped(journal)

    async def rows(self, since: int, until: int):
        return await self.store.rows(since, until)


@pytest.fixture
async def store(tmp_path):
    store = SqliteUsageStore(tmp_path / "tenancy.sqlite3")
    yield store
    await store.close()


async def test_a_batch_applied_twice_counts_once(store):
    row = UsageRow("k-a", "a", "", "tiny", HOUR)
    counts = [1] * len(FIELDS)
    assert await store.apply(Batch("seg", 10, {row: counts}))
    assert not await store.apply(Batch("seg", 10, {row: counts}))
    assert not await store.apply(Batch("seg", 5, {row: counts}))  # an older batch of that journal
    assert await store.apply(Batch("seg", 20, {row: counts}))
    assert await store.apply(Batch("other", 1, {row: counts}))
    assert await totals(store) == {"a": (3, 3, 3)}
    assert await store.shipped("seg") == 20


@pytest.mark.parametrize("journaled", [True, False])
async def test_a_flush_whose_answer_was_lost_is_retried_and_counted_once(store, tmp_path, journaled):
    flaky = FlakyStore(store)
    sink = UsageAggregator()
    journal = UsageJournal(tmp_path / "journal") if journaled else None
    flusher = UsageFlusher(sink, flaky, journal, interval=0.01)
    if journal:
        journal.open()
    sink.record(answer("a"))
    flaky.lose_answers = 2
    await flusher.flush()
    assert flaky.applied == 3  # the first went in, its answer lost twice; the repeats were skipped by the marker
    sink.record(answer("a"))
    await flusher.flush()
    assert await totals(store) == {"a": (2, 20, 14)}


async def through_an_outage(flusher: UsageFlusher, names: list[str], check=lambda: None) -> None:
    """A flush that meets the store away (its first answer ``first``), while answers of ``names`` come in one by
    one; ``check`` before the store is back; then one more flush."""
    flusher.sink.record(answer("first"))
    flaky = flusher.store
    flaky.down = True
    async with trio.open_nursery() as nursery:
        nursery.start_soon(flusher.flush)
        for name in names:
            await trio.sleep(0.005)
            flusher.sink.record(answer(name))
        check()
        flaky.down = False
    await flusher.flush()


def journaled(store, tmp_path, **options) -> UsageFlusher:
    journal = UsageJournal(tmp_path / "journal")
    journal.open()
    return UsageFlusher(UsageAggregator(), FlakyStore(store), journal, interval=0.01, **options)


async def test_usage_waits_while_the_store_is_away_and_arrives_once_when_it_is_back(store, tmp_path):
    flusher = journaled(store, tmp_path)

    def waiting():
        assert flusher.waiting

    await through_an_outage(flusher, ["b"] * 20, waiting)
    assert await totals(store) == {"first": (1, 10, 7), "b": (20, 200, 140)}


async def test_past_the_memory_bound_usage_is_read_back_from_the_journal(store, tmp_path):
    flusher = journaled(store, tmp_path, max_pending_rows=5)

    def bounded():
        assert flusher.sink.pending_rows <= 6

    await through_an_outage(flusher, [f"key{index}" for index in range(40)], bounded)
    found = await totals(store)
    assert found == {"first": (1, 10, 7), **{f"key{index}": (1, 10, 7) for index in range(40)}}


async def test_without_a_journal_rows_past_the_memory_bound_are_counted_as_lost(store):
    lost = []
    flusher = UsageFlusher(UsageAggregator(), FlakyStore(store), None, interval=0.01, max_pending_rows=5,
                           on_lost=lost.append)
    await through_an_outage(flusher, [f"key{index}" for index in range(20)])
    assert sum(lost) >= 6
    found = await totals(store)
    assert "first" in found and len(found) + sum(lost) == 21


async def test_a_killed_process_journal_is_replayed_from_the_store_marker_once(store, tmp_path):
    directory = tmp_path / "journal"
    sink = UsageAggregator()
    journal = UsageJournal(directory)
    journal.open()
    flusher = UsageFlusher(sink, store, journal, interval=0.01)
    sink.record(answer("shipped"))
    await flusher.flush()
    for _ in range(3):
        sink.record(answer("settled-not-shipped"))
    journal.close()  # as a kill -9 leaves it: the lock gone, the file there
    assert len(list(directory.iterdir())) == 1

    second = UsageFlusher(UsageAggregator(), store, UsageJournal(directory), interval=0.01)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await nursery.start(second.run)
            while len(list(directory.iterdir())) != 1 or (await totals(store)).get("settled-not-shipped") is None:
                await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    assert await totals(store) == {"shipped": (1, 10, 7), "settled-not-shipped": (3, 30, 21)}


async def test_a_live_process_journal_is_not_replayed_by_another(store, tmp_path):
    directory = tmp_path / "journal"
    sink = UsageAggregator()
    journal = UsageJournal(directory)
    journal.open()
    UsageFlusher(sink, store, journal, interval=0.01)
    sink.record(answer("alive"))
    other = UsageFlusher(UsageAggregator(), store, UsageJournal(directory), interval=0.01)
    await other.replay_orphans()
    assert await totals(store) == {}
    journal.close()


async def test_shipped_segments_are_rotated_and_deleted(store, tmp_path):
    directory = tmp_path / "journal"
    sink = UsageAggregator()
    journal = UsageJournal(directory, rotate_bytes=200)
    journal.open()
    flusher = UsageFlusher(sink, store, journal, interval=0.01)
    for index in range(30):
        sink.record(answer(f"k{index % 3}"))
        await flusher.flush()
    assert len(list(directory.iterdir())) == 1
    assert await totals(store) == {f"k{i}": (10, 100, 70) for i in range(3)}
    journal.close()


async def test_a_stop_flushes_what_is_left(store, tmp_path):
    sink = UsageAggregator()
    flusher = UsageFlusher(sink, store, UsageJournal(tmp_path / "journal"), interval=3600)
    async with trio.open_nursery() as nursery:
        await nursery.start(flusher.run)
        sink.record(answer("late"))
        nursery.cancel_scope.cancel()
    assert await totals(store) == {"late": (1, 10, 7)}
    assert list((tmp_path / "journal").iterdir())  # the segment stays; the marker says it is all shipped
    assert await UsageFlusher(UsageAggregator(), store, UsageJournal(tmp_path / "journal"), 1).replay_orphans() \
        is None
    assert await totals(store) == {"late": (1, 10, 7)}


def test_replay_reads_whole_lines_and_skips_what_is_not_a_usage_line(tmp_path):
    path = tmp_path / "x.usage"
    row = UsageRow("k-a", "a", "", "tiny", HOUR)
    line = encode(row, [1] * len(FIELDS))
    path.write_bytes(line + b"garbage\n" + b"[1,2]\n" + b"x" * 10_000 + b"\n" + line + line[:20])
    rows, end, skipped = read_rows(path, 0)
    assert rows == {row: [2] * len(FIELDS)}
    assert skipped == 3
    assert end == os.path.getsize(path) - 20  # the torn last line is not read


async def test_budget_spent_sums_keys_and_teams_per_period(store):
    day = HOUR - 3600  # 2026-11-30T00:00Z
    await store.apply(Batch("s", 1, {
        UsageRow("k-a", "a", "t", "tiny", day - 3600): [1, 100, 0, 10, 50, 1, 0, 0, 0, 0, 0, 0],  # the day before
        UsageRow("k-a", "a", "t", "tiny", HOUR): [1, 100, 40, 10, 50, 1, 0, 0, 0, 0, 0, 0],
        UsageRow("k-b", "b", "t", "big", HOUR): [1, 10, 0, 1, 7, 1, 0, 0, 0, 0, 0, 0],
        UsageRow("k-c", "c", "", "big", HOUR): [1, 10, 0, 1, 7, 1, 0, 0, 0, 0, 0, 0],
    }))
    settings = TenancySettings(cached_input_weight=0.5)
    spent = {(s.kind, s.name, s.period): (s.tokens, s.nano_usd)
             for s in await budget_spent(store, settings, now=HOUR + 100)}
    assert spent[("key", "k-a", "day")] == (60 + 20 + 10, 50)
    assert spent[("key", "k-a", "month")] == (110 + 90, 100)  # November
    assert spent[("key", "k-a", "total")] == (110 + 90, 100)
    assert spent[("team", "t", "day")] == (90 + 11, 57)
    assert ("team", "", "day") not in spent
    assert spent[("key", "k-c", "total")] == (11, 7)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes_decode_to_a_usage_line_or_none(raw):
    decoded = decode(raw)
    assert decoded is None or (len(decoded[1]) == len(FIELDS) and decoded[0].hour % 3600 == 0)


@settings(max_examples=200, deadline=None)
@given(st.tuples(st.text(max_size=30), st.text(max_size=30), st.text(max_size=30), st.text(max_size=30)),
       st.integers(0, 2**40).map(lambda n: n * 3600), st.lists(st.integers(0, 2**53 - 1), min_size=12, max_size=12),
       st.sampled_from(["", "interactive", "batch", '"odd|class']))
def test_every_row_round_trips_through_a_journal_line_and_a_redis_field(texts, hour, counts, priority):
    row = UsageRow(*texts, hour, priority)
    line = encode(row, counts)
    assert line.count(b"\n") == 1 and decode(line[:-1]) == (row, counts)
    for index, name in enumerate(FIELDS):
        assert parse_field(row_field(row, name).encode(), hour) == (row, index)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_any_redis_field_parses_or_is_skipped(raw):
    parsed = parse_field(raw, HOUR)
    assert parsed is None or 0 <= parsed[1] < len(FIELDS)


async def test_a_journal_folder_that_cannot_be_written_leaves_usage_in_memory_and_the_store(store, tmp_path,
                                                                                           caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    sink = UsageAggregator()
    flusher = UsageFlusher(sink, store, UsageJournal(blocked / "journal"), interval=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(flusher.run)
        sink.record(answer("a"))
        with trio.fail_after(10):
            while not await totals(store):
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert await totals(store) == {"a": (1, 10, 7)}
    assert "usage journal: cannot write in" in caplog.text


async def test_sqlite_keeps_rows_for_the_retention_and_prunes_older_ones(tmp_path):
    now = [float(HOUR)]
    store = SqliteUsageStore(tmp_path / "t.sqlite3", clock=lambda: now[0], retention=48 * 3600)
    old, kept = UsageRow("k-a", "a", "", "tiny", HOUR - 49 * 3600), UsageRow("k-a", "a", "", "tiny", HOUR - 3600)
    await store.apply(Batch("s", 1, {old: [1] * len(FIELDS), kept: [1] * len(FIELDS)}))
    assert await store.rows(0, 2**40) == [(kept, [1] * len(FIELDS))]  # the old hour went at once
    now[0] += 1800
    await store.apply(Batch("s", 2, {old: [1] * len(FIELDS), kept: [1] * len(FIELDS)}))
    assert len(await store.rows(0, 2**40)) == 2  # pruned at most once an hour
    now[0] += 3600
    await store.apply(Batch("s", 3, {kept: [1] * len(FIELDS)}))
    assert await store.rows(0, 2**40) == [(kept, [3] * len(FIELDS))]
    await store.close()


async def test_usage_creates_the_shared_tenancy_file_private_to_its_owner(tmp_path):
    """Usage and the key store share ``tenancy.store``: whichever opens it first makes it 0600 in a 0700 folder
    (it holds the keys' hashes), so usage writing first must not leave it readable by others."""
    path = tmp_path / "state" / "tenancy.sqlite3"
    store = SqliteUsageStore(path)
    await store.apply(Batch("s", 1, {UsageRow("k-a", "a", "", "tiny", HOUR): [1] * len(FIELDS)}))
    await store.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_lines_and_fields_written_before_classes_read_as_rows_of_no_class():
    """A journal line or a Redis hash field from a gateway of before priority classes (4 texts, no class) is the
    same row as one of no class now, so an upgrade neither drops nor splits its usage."""
    counts = list(range(len(FIELDS)))
    old_line = ('["k-a","a","t","tiny",%d,' % HOUR + ",".join(map(str, counts)) + "]").encode()
    assert decode(old_line) == (UsageRow("k-a", "a", "t", "tiny", HOUR, ""), counts)
    assert encode(UsageRow("k-a", "a", "t", "tiny", HOUR), counts) == old_line + b"\n"
    assert parse_field(b'["k-a","a","t","tiny"]|requests', HOUR) == (UsageRow("k-a", "a", "t", "tiny", HOUR), 0)
    assert parse_field(b'["k-a","a","t","tiny","batch"]|requests', HOUR) == (
        UsageRow("k-a", "a", "t", "tiny", HOUR, "batch"), 0)
    assert parse_field(b'["k-a","a","t","tiny","batch",1]|requests', HOUR) is None
    assert parse_field(b'["k-a","a","t","tiny",5]|requests', HOUR) is None
    assert decode(('["k-a","a","t","tiny",%d,7,' % HOUR + ",".join(map(str, counts)) + "]").encode()) is None


def test_the_aggregator_keeps_classes_of_one_key_apart():
    sink = UsageAggregator(clock=lambda: HOUR + 5)
    sink.record(UsageRecord("k-a", "a", "t", "tiny", Usage(10, 3, 0, 7), 200, HOUR + 5, "interactive"))
    sink.record(UsageRecord("k-a", "a", "t", "tiny", Usage(10, 3, 0, 7), 200, HOUR + 5))
    tenant = Tenant("k-a", "a", Team("t"))
    for _ in range(3):
        sink.refused(tenant, "tiny", RATE_LIMITED, priority="batch")
    rows = sink.take()
    assert rows[UsageRow("k-a", "a", "t", "tiny", HOUR, "interactive")][REQUESTS] == 1
    assert rows[UsageRow("k-a", "a", "t", "tiny", HOUR)][REQUESTS] == 1
    assert rows[UsageRow("k-a", "a", "t", "tiny", HOUR, "batch")][FIELDS.index("refused_rate")] == 3
    assert len(rows) == 3


_OLD_SCHEMA = f"""
CREATE TABLE usage_hourly (
    hour INTEGER NOT NULL, key_id TEXT NOT NULL, key_name TEXT NOT NULL, team TEXT NOT NULL, model TEXT NOT NULL,
    {", ".join(f"{field} INTEGER NOT NULL DEFAULT 0" for field in FIELDS)},
    PRIMARY KEY (hour, key_id, key_name, team, model));
CREATE TABLE usage_shipped (journal TEXT PRIMARY KEY, offset INTEGER NOT NULL, at REAL NOT NULL);
"""


async def test_a_sqlite_file_of_before_classes_is_migrated_with_its_rows_kept(tmp_path, caplog):
    path = tmp_path / "t.sqlite3"
    db = sqlite3.connect(path)
    db.executescript(_OLD_SCHEMA)
    db.execute(f"INSERT INTO usage_hourly VALUES (?, 'k-a', 'a', 't', 'tiny', {', '.join('2' for _ in FIELDS)})",
               (HOUR,))
    db.execute("INSERT INTO usage_shipped VALUES ('s', 10, 0)")
    db.commit()
    db.close()
    store = SqliteUsageStore(path, clock=lambda: float(HOUR))
    assert await store.rows(0, 2**40) == [(UsageRow("k-a", "a", "t", "tiny", HOUR), [2] * len(FIELDS))]
    assert await store.shipped("s") == 10
    assert "migrated to count usage per priority class (1 rows kept" in caplog.text
    batch = {UsageRow("k-a", "a", "t", "tiny", HOUR): [1] * len(FIELDS),
             UsageRow("k-a", "a", "t", "tiny", HOUR, "batch"): [5] * len(FIELDS)}
    assert await store.apply(Batch("s", 11, batch))
    assert sorted(await store.rows(0, 2**40)) == [(UsageRow("k-a", "a", "t", "tiny", HOUR), [3] * len(FIELDS)),
                                                  (UsageRow("k-a", "a", "t", "tiny", HOUR, "batch"),
                                                   [5] * len(FIELDS))]
    await store.close()
    caplog.clear()
    reopened = SqliteUsageStore(path, clock=lambda: float(HOUR))  # migrated once: opened again, nothing changes
    assert len(await reopened.rows(0, 2**40)) == 2 and "migrated" not in caplog.text
    await reopened.close()
