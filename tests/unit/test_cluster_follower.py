"""A follower's log entries without Redis: a KV change of a replica this gateway does not route to gets no index
slot (a replica nobody publishes must not take one of the index's slots, nor its memory)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from llmgw.cluster import records
from llmgw.cluster.follower import FollowedReplicas, LogFollower
from llmgw.cluster.link import RedisLink
from llmgw.cluster.metrics import ClusterMetrics
from llmgw.cluster.records import Keys, ReplicaRecord
from llmgw.config.loading import parse_config
from llmgw.kv.changes import BlockChanges, KvChangeKind
from llmgw.kv.index import KvIndex
from llmgw.router.replica import Replica
from llmgw.router.replicas import ReplicaSet


def follower() -> tuple[LogFollower, KvIndex, CollectorRegistry]:
    settings = parse_config("state: {backend: redis, url: 'redis://127.0.0.1:1', secret_env: S}\n").state
    registry = CollectorRegistry()
    metrics = ClusterMetrics(registry, "gateway", "c", "me")
    followed = FollowedReplicas(ReplicaSet(), lambda record: Replica(name=record.name, model=record.model,
                                                                      url=record.url))
    index = KvIndex()
    return LogFollower(RedisLink(settings, metrics), Keys("c"), followed, index, metrics), index, registry


def test_a_kv_change_of_a_replica_not_routed_here_gets_no_index_slot():
    log, index, registry = follower()
    log._apply([records.ADD, ReplicaRecord("sim-0", "m", "http://127.0.0.1:1", "deployed")])
    for name in ("sim-0", "ghost"):
        log._apply([records.KV, name, BlockChanges(KvChangeKind.FULL, 16, [1, 2, 3])])
    assert index.replicas() == ["sim-0"] and index.blocks("sim-0") == 3
    assert registry.get_sample_value("llmgw_cluster_log_entries_total", {"direction": "ignored", "kind": "kv"}) == 1
    log._apply([records.KV_DROP, "ghost"])  # dropping what is not there is harmless
    assert index.replicas() == ["sim-0"]
