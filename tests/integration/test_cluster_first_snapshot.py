"""A leader's first snapshot, and the changes made while Redis writes it: every one reaches the followers.

The writer used to drop every change until its first snapshot's write returned, although the snapshot was
built before that write: a change in between was in neither. A follower that loaded the snapshot then differed
from the leader's KV index for good (nothing sends it to a snapshot again), which is what a new leader's
followers showed under load in ``llmgw bench fault --gateways 3`` (their index equal to the leader's only 10 to
28 s after the failover, when the engines' caches filled and the block counts met again).

Real Redis (``redis-server``), the real writer, fence, election and follower; the writer is held between building
its snapshot and writing it (a fence that waits at ``snapshot_write``) so the change lands in that window.
"""

from __future__ import annotations

from typing import Any, Sequence

import trio

from llmgw.cluster.election import Election, Fence
from llmgw.cluster.follower import FollowedReplicas, LogFollower
from llmgw.cluster.link import RedisLink
from llmgw.cluster.metrics import ClusterMetrics
from llmgw.cluster.records import Keys, ReplicaRecord
from llmgw.cluster.writer import LogWriter, PublishedKv
from llmgw.config.loading import parse_config
from llmgw.kv.changes import BlockChanges, KvChangeKind
from llmgw.kv.index import KvIndex
from llmgw.router.replica import Replica
from llmgw.router.replicas import STATIC, ReplicaSet
from llmgw.testing.shared_state import state_section


def engine_replica(record: ReplicaRecord) -> Replica:
    return Replica(name=record.name, model=record.model, url=record.url)


class HeldSnapshotFence(Fence):
    """The leader's fence, stopping each snapshot write until :attr:`go` is set (and saying it got there)."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.reached = trio.Event()
        self.go = trio.Event()

    async def run(self, operation: str, commands: Sequence[Sequence[Any]], timeout: float | None = None) -> list[Any]:
        if operation == "snapshot_write":
            self.reached.set()
            await self.go.wait()
        return await super().run(operation, commands, timeout)


async def test_a_change_made_while_the_first_snapshot_is_written_reaches_the_followers(nursery, redis_url,
                                                                                      cluster_name):
    settings = parse_config(state_section(redis_url, cluster_name)).state
    keys = Keys(cluster_name)
    metrics = ClusterMetrics(None, "control", cluster_name, "leader")
    link = RedisLink(settings, metrics)
    await nursery.start(link.run)
    election = Election(link, keys, settings, metrics, "leader")
    election.listening("http://leader.invalid:1")
    await nursery.start(election.run)
    term = await election.wait_elected()
    index = KvIndex()
    table = ReplicaSet()  # the replica whose KV it is (a follower gives no index slot to one not in its table)
    table.add(engine_replica(ReplicaRecord("engine-0", "m", "http://127.0.0.1:1", STATIC)), STATIC)
    index.apply("engine-0", BlockChanges(KvChangeKind.FULL, 16, [1, 2, 3]))
    fence = HeldSnapshotFence(link, keys, election, term, metrics)
    writer = LogWriter(link, keys, settings, table, index, metrics, "leader.1.1", fence)
    kv = PublishedKv(index, writer)
    await nursery.start(writer.run, lambda: True)
    with trio.fail_after(10):
        await fence.reached.wait()  # the snapshot holds blocks 1-3; its write has not returned
    kv.apply("engine-0", BlockChanges(KvChangeKind.DELTA, 16, stored=[4]))
    fence.go.set()

    follower_metrics = ClusterMetrics(None, "gateway", cluster_name, "follower")
    follower_link = RedisLink(settings, follower_metrics)
    await nursery.start(follower_link.run)
    copy = KvIndex()
    follower = LogFollower(follower_link, keys, FollowedReplicas(ReplicaSet(), engine_replica), copy,
                           follower_metrics)
    await nursery.start(follower.run)
    assert await follower.wait_loaded(10)
    with trio.move_on_after(10):
        while copy.keys("engine-0") != index.keys("engine-0"):
            await trio.sleep(0.02)
    assert copy.keys("engine-0") == index.keys("engine-0") == {1, 2, 3, 4}
    nursery.cancel_scope.cancel()
