"""The control process's log writer (llmgw.cluster.writer) against a fake Redis link: it sleeps while nothing
changes (it used to spin at 100% CPU once a snapshot interval went by idle), and a change after a quiet interval
is written with a snapshot."""

from __future__ import annotations

import contextlib

import trio

from llmgw.cluster import records
from llmgw.cluster.metrics import ClusterMetrics
from llmgw.cluster.records import Keys
from llmgw.cluster.writer import LogWriter
from llmgw.config.loading import parse_config
from llmgw.kv.index import KvIndex
from llmgw.router.replicas import ReplicaSet


class FakeClient:
    """What the writer calls on a coredis client: XADD, GET, and a pipeline of SET/PEXPIRE."""

    def __init__(self):
        self.appended = 0
        self.stored: dict[str, bytes] = {}

    async def xadd(self, key, fields, **options):
        self.appended += 1
        return b"%d-0" % self.appended

    async def get(self, key):
        return self.stored.get(key)

    @contextlib.asynccontextmanager
    async def pipeline(self, transaction=False):
        yield self

    def set(self, key, value):
        self.stored[key] = value

    def pexpire(self, key, ms):
        pass


class FakeLink:
    def __init__(self):
        self.client = FakeClient()

    async def call(self, operation, command, timeout=None):
        return await command(self.client)

    @staticmethod
    async def backoff(attempt):
        await trio.sleep(0.1)


class CountingWriter(LogWriter):
    """Counts the loop's turns (each one reads ``need_snapshot``)."""

    turns = 0

    @property  # type: ignore[override]
    def need_snapshot(self):
        self.turns += 1
        return self._need

    @need_snapshot.setter
    def need_snapshot(self, value):
        self._need = value


def writer() -> CountingWriter:
    settings = parse_config("state:\n  backend: redis\n  url: redis://127.0.0.1:1\n  snapshot_interval: 0.1s\n").state
    return CountingWriter(FakeLink(), Keys("test"), settings, ReplicaSet(), KvIndex(),
                          ClusterMetrics(None, "control", "test", "w1"), "w1")


async def test_an_idle_writer_sleeps_past_its_snapshot_interval_and_wakes_for_a_change(nursery):
    log = writer()
    await nursery.start(log.run, lambda: True)
    while not log.published:
        await trio.sleep(0.01)
    turns = log.turns
    await trio.sleep(0.5)  # five snapshot intervals with nothing changed
    assert log.turns - turns <= 2  # asleep (a spinning loop turns thousands of times here)
    client = log.link.client
    appended = client.appended
    log.record(["drain", "sim-0", "a test"])  # a snapshot is due (the interval went by): the change goes into one
    with trio.fail_after(5):
        while client.appended == appended or log.dirty:
            await trio.sleep(0.01)
    assert records.unpack(client.stored[log.keys.snapshot])["seq"] == log.seq == appended + 1
