"""Shared predictions without Redis: what the routing path buffers (bounded, dropped when full or expired), and
how another process's batch is applied (its own skipped, the ttl left after the age, unknown replicas ignored)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from llmgw.cluster import learn, records
from llmgw.cluster.learn import PredictionSharing
from llmgw.cluster.link import RedisLink
from llmgw.cluster.metrics import ClusterMetrics
from llmgw.cluster.records import Keys
from llmgw.config.loading import parse_config
from llmgw.kv.changes import BlockChanges, KvChangeKind
from llmgw.kv.index import KvIndex
from llmgw.router.replica import Replica
from llmgw.router.replicas import ReplicaSet


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def sharing(origin: str = "me", replicas: tuple[str, ...] = ("a", "b")):
    settings = parse_config("state: {backend: redis, url: 'redis://127.0.0.1:1', secret_env: S}\n").state
    registry = CollectorRegistry()
    metrics = ClusterMetrics(registry, "gateway", "c", origin)
    table = ReplicaSet()
    clock = Clock()
    index = KvIndex(clock=clock, predicted_ttl=2.0)
    for name in replicas:
        table.add(Replica(name=name, model="m", url=f"http://127.0.0.1:1/{name}"))
        index.apply(name, BlockChanges(KvChangeKind.FULL, 16, []))
    shared = PredictionSharing(RedisLink(settings, metrics), Keys("c"), table, index, metrics, origin,
                               wall_clock=clock)
    return shared, index, clock, registry


def counted(registry: CollectorRegistry, direction: str) -> float:
    return registry.get_sample_value("llmgw_cluster_predictions_total", {"direction": direction}) or 0.0


def test_the_routing_path_only_buffers_what_the_index_predicts():
    shared, index, clock, registry = sharing()
    index.predict("a", [1, 2, 3])
    index.predict("b", [4], ttl=0.5)
    assert shared.outbox._wake.is_set()  # the sender is woken
    assert shared.take_pending() == [["a", 1_000_000, 2000, [1, 2, 3]], ["b", 1_000_000, 500, [4]]]
    assert shared.take_pending() == []


def test_a_full_buffer_drops_and_counts_and_expired_ones_are_not_sent(monkeypatch):
    monkeypatch.setattr(learn, "MAX_PENDING", 2)
    shared, index, clock, registry = sharing()
    for key in range(3):
        index.predict("a", [key])  # routing goes on: the third is dropped
    assert counted(registry, "dropped") == 1
    monkeypatch.setattr(learn, "MAX_PENDING_KEYS", 4)
    shared.take_pending()
    index.predict("a", [1, 2, 3])
    index.predict("a", [4, 5])  # 5 keys pending would be too many
    assert counted(registry, "dropped") == 2
    shared.take_pending()
    index.predict("a", [1], ttl=1.0)
    index.predict("a", [2], ttl=3.0)
    clock.now += 2.0  # Redis was slow: the first one expired waiting
    assert shared.take_pending() == [["a", 1_000_000, 3000, [2]]]
    assert counted(registry, "dropped") == 3


def batch(origin: str, *items: list) -> dict:
    return {"o": origin.encode(), "e": records.pack(list(items))}


async def test_another_processs_predictions_count_for_the_ttl_they_have_left():
    shared, index, clock, registry = sharing()
    made = int(clock.now * 1000) - 500  # made 0.5 s ago, for 2 s
    assert await shared.take_batch(batch("other", records.learn_item("a", made, 2000, [1, 2]))) == 1
    assert index.match([1, 2], ["a", "b"]) == {"a": 2, "b": 0}
    assert shared.take_pending() == []  # applied, not echoed back
    clock.now += 1.49
    assert index.match([1, 2], ["a"]) == {"a": 2}
    clock.now += 0.02
    assert index.match([1, 2], ["a"]) == {"a": 0}
    assert counted(registry, "received") == 1


async def test_a_clock_ahead_or_far_behind_is_clamped_to_the_ttl():
    shared, index, clock, registry = sharing()
    ahead = int(clock.now * 1000) + 60_000  # the origin's clock is ahead: counts its whole ttl, no more
    assert await shared.take_batch(batch("other", records.learn_item("a", ahead, 1000, [1]))) == 1
    clock.now += 0.99
    assert index.match([1], ["a"]) == {"a": 1}
    clock.now += 0.02
    assert index.match([1], ["a"]) == {"a": 0}
    stale = int(clock.now * 1000) - 5000  # expired before it arrived
    assert await shared.take_batch(batch("other", records.learn_item("a", stale, 1000, [2]))) == 0
    assert index.match([2], ["a"]) == {"a": 0} and counted(registry, "ignored") == 1


async def test_its_own_predictions_and_unknown_replicas_are_not_applied():
    shared, index, clock, registry = sharing(replicas=("a",))
    now = int(clock.now * 1000)
    assert await shared.take_batch(batch("me", records.learn_item("a", now, 2000, [1]))) == 0
    index.predict("gone", [9])  # a replica this process's index knows, but not its table
    shared.take_pending()
    applied = await shared.take_batch(batch("other", records.learn_item("ghost", now, 2000, [5]),
                                      records.learn_item("gone", now, 2000, [6]),
                                      records.learn_item("a", now, 2000, [7])))
    assert applied == 1 and counted(registry, "ignored") == 2 and counted(registry, "received") == 1
    assert "ghost" not in index.replicas() and index.match([6], ["gone"]) == {"gone": 0}
    assert index.match([1], ["a"]) == {"a": 0} and index.match([7], ["a"]) == {"a": 1}


async def test_a_bad_batch_is_counted_and_skipped():
    shared, index, clock, registry = sharing()
    for fields in ({"o": b"other", "e": b"\xc1"}, {"o": b"other"}, {"e": records.pack([])},
                   {"o": b"\xff\xfe", "e": records.pack([])}, batch("other", ["a", 1, 2])):
        assert await shared.take_batch(fields) == 0
    assert registry.get_sample_value("llmgw_cluster_bad_records_total", {"stream": "learn"}) == 5


async def test_a_batch_is_bounded_to_what_one_sender_buffers_and_to_the_readers_ttl():
    """A prediction's time to live is clamped to this process's predicted_ttl (not the 600 s a sender may write),
    and a batch's keys to the sender's buffer: the rest is clamped off, not applied."""
    shared, index, clock, registry = sharing()
    now = int(clock.now * 1000)
    assert await shared.take_batch(batch("other", records.learn_item("a", now, records.MAX_LEARNED_TTL_MS, [1]))) == 1
    clock.now += 2.01
    assert index.match([1], ["a"]) == {"a": 0}  # gone after predicted_ttl (2 s), not 600 s
    now = int(clock.now * 1000)
    keys = list(range(records.LEARN_MAX_KEYS))
    applied = await shared.take_batch(batch("other", records.learn_item("a", now, 2000, keys),
                                            records.learn_item("a", now, 2000, [-1, -2])))
    assert applied == 1  # the second had no keys left in the batch's budget
    assert index.match(keys[:3], ["a"]) == {"a": 3} and index.match([-1], ["a"]) == {"a": 0}


async def test_a_large_batch_is_applied_in_slices_that_let_other_tasks_run():
    import trio

    shared, index, clock, registry = sharing()
    now = int(clock.now * 1000)
    keys = list(range(learn.KEYS_PER_SLICE * 4))
    seen = []

    async def other_task():
        while True:
            seen.append(index.match(keys, ["a"])["a"])  # how many of the batch's keys are applied so far
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        await trio.lowlevel.checkpoint()
        assert await shared.take_batch(batch("other", records.learn_item("a", now, 2000, keys))) == 1
        nursery.cancel_scope.cancel()
    assert any(0 < applied < len(keys) for applied in seen)  # the loop ran while the batch was half applied
