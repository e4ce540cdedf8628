"""Deployed replicas put in routing without agents: what the leader does once every shard reports ready."""

from __future__ import annotations

from .. import wire
from ..config import Config
from ..control.deployed import DeployedReplicas
from ..control.fingerprint import profile_fingerprint
from ..control.reconciler import Assignment, ShardSlot, desired_replicas
from ..metrics import Metrics
from ..plugin import Registry
from ..router.replicas import ReplicaSet
from ..router.router import Router


def deploy_ready(config: Config, registry: Registry) -> ReplicaSet:
    """A replica set holding every replica ``config``'s deployments ask for, each one shard on node ``n1``
    reported ready at ``http://127.0.0.1:9`` (generation 1)."""
    replicas = ReplicaSet()
    Router(registry, Metrics(), replicas)
    routing = DeployedReplicas(replicas, registry, on_released=lambda key: None)
    desired = desired_replicas(config, profile_fingerprint)
    routing.configure_models(desired)

    def assignment(replica) -> Assignment:
        return Assignment(replica.replica_id, replica.profile.name, replica.model, replica.fingerprint, 1,
                          [ShardSlot(f"{replica.replica_id}-g1-r0", "n1", 0, (), ())])

    def ready(a: Assignment) -> wire.ShardReport:
        return wire.ShardReport(shard_id=a.leader.shard_id, replica_id=a.replica_id, state=wire.ShardState.READY,
                                endpoint="http://127.0.0.1:9", generation=1)

    routing.sync([assignment(r) for r in desired.values()], ready, lambda a: None)
    return replicas
