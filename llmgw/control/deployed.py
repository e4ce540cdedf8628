"""Deployed replicas in the replica set: in when their rank-0 shard is Ready, out when it is not, drained when retired.

The ``deployed`` source of the :class:`~llmgw.router.replicas.ReplicaSet`.
:meth:`DeployedReplicas.sync` is called after every reconcile. For each wanted
assignment it looks at the last report of its leader shard:

- READY with an endpoint: the replica (named after its replica id, serving the
  profile's ``served_model_name``) is in routing, at that endpoint;
- any other state (PENDING, STARTING, LOADING, DRAINING, FAILED, STOPPED): out;
- no report at all (its node is disconnected and said nothing since the
  control plane started): left as it is. A disconnected node's replicas keep
  serving while their own health probes pass.

A retiring assignment that is in routing is drained: marked draining (no new
requests), then removed once its in-flight requests have finished (or after
``drain_timeout``); only then is it *released* and may its shards be stopped.

Models are configured per served model name with the profile's routing tier
(its name was checked with the config, like a static model's: an unknown one
never gets here).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from .. import wire
from ..engines.probe import VLLM_GAUGES, EngineGauges, engine_gauges
from ..router.model import TierModel
from ..router.replica import Replica
from ..router.replicas import DEPLOYED
from .interfaces import ReplicaTable
from .reconciler import Assignment, DesiredReplica
from .tasks import TaskHost

log = logging.getLogger(__name__)


@dataclass
class Routed:
    key: str  # the assignment's key: replica id and generation
    replica: Replica
    draining: bool = False


class DeployedReplicas(TaskHost):
    not_running = "DeployedReplicas.run is not running"

    def __init__(self, replicas: ReplicaTable, registry, on_released: Callable[[str], None],
                 drain_timeout: float = 600.0, on_failure: Callable[[], None] = lambda: None):
        """``registry``: the plugin registry (is a profile's routing tier installed?); ``on_released(key)``: a
        retired assignment left the set (its shards may be stopped); ``on_failure()``: an assignment could not be
        applied (counted)."""
        self.replicas = replicas
        self.registry = registry
        self.on_released = on_released
        self.drain_timeout = drain_timeout
        self.on_failure = on_failure
        self._failures: dict[str, str] = {}  # replica id -> the failure last logged for it
        self.routed: dict[str, Routed] = {}  # by replica id
        self.models: dict[str, str] = {}  # served model name -> the tier it is declared with
        self.gauges: dict[str, EngineGauges] = {}  # served model name -> its engine plugin's load gauges
        self.prefill_rates: dict[str, float | None] = {}  # profile name -> its configured prefill_tokens_per_s
        self.priority_profiles: set[str] = set()  # names of the profiles whose engines run priority scheduling

    # -- models --------------------------------------------------------------------------------------------------

    def configure_models(self, desired: Mapping[str, DesiredReplica], held: Iterable[Any] = ()) -> None:
        """Declare one model per served model name of a deployed profile, and of each profile in ``held`` (an
        autoscaled deployment's, declared even with no replica: its requests wait for the first); withdraw those
        nobody deploys any more (a model the config's ``models`` list too keeps its route)."""
        wanted: dict[str, Any] = {}  # model -> the llmgw.config.Profile that serves it
        self.prefill_rates = {}
        self.priority_profiles = set()
        for profile in [*(replica.profile for replica in desired.values()), *held]:
            wanted.setdefault(profile.served_model_name, profile)
            self.prefill_rates[profile.name] = profile.prefill_tokens_per_s
            if profile.scheduling_policy == "priority":
                self.priority_profiles.add(profile.name)
        for model, profile in sorted(wanted.items()):
            tier = profile.routing
            self.replicas.declare_model(DEPLOYED, TierModel.of(
                model, tier, profile.routing_options, model_path=profile.model_path,
                lora_adapters=profile.lora_adapters, engine_args=profile.args))
            self.models[model] = tier
            self.gauges[model] = engine_gauges(self.registry, profile.engine)
        for model in list(self.models):
            if model not in wanted:
                del self.models[model]
                self.gauges.pop(model, None)
                if self.replicas.withdraw_model(DEPLOYED, model):
                    log.info("model %s is no longer deployed: new requests for it are refused", model)

    # -- replicas ------------------------------------------------------------------------------------------------

    def sync(self, assignments: Iterable[Assignment], leader_report: Callable[[Assignment], wire.ShardReport | None],
             api_key: Callable[[Assignment], str | None]) -> None:
        """Bring the replica set in step with the assignments. A failure to apply one assignment (an exception
        building its replica) is contained: logged once, counted through ``on_failure``, and the others synced."""
        for assignment in sorted(assignments, key=lambda a: (a.replica_id, a.generation)):
            try:
                self._sync_one(assignment, leader_report, api_key)
            except Exception as exc:
                self._failed(assignment, exc)
            else:
                self._failures.pop(assignment.replica_id, None)

    def _sync_one(self, assignment: Assignment, leader_report: Callable[[Assignment], wire.ShardReport | None],
                  api_key: Callable[[Assignment], str | None]) -> None:
        if assignment.retiring:
            self._retire(assignment)
            return
        report = leader_report(assignment)
        if report is None:
            return
        current = self.routed.get(assignment.replica_id)
        if current is not None and current.key != assignment.key:
            return  # the previous generation is still draining under this name
        if report.state is wire.ShardState.READY and report.endpoint:
            if current is not None and current.replica.url == report.endpoint:
                return
            if current is not None:
                self._remove(current, f"its endpoint moved to {report.endpoint}")
            self._add(assignment, report, api_key(assignment))
        elif current is not None:
            self._remove(current, f"shard {report.shard_id} is {report.state.value}"
                                  + (f": {report.reason}" if report.reason else ""))

    def _failed(self, assignment: Assignment, exc: Exception) -> None:
        failure = f"{type(exc).__name__}: {exc}"[:500]
        if self._failures.get(assignment.replica_id) == failure:
            return  # logged and counted once; every reconcile pass would repeat it
        self._failures[assignment.replica_id] = failure
        self.on_failure()
        log.error("replica %s (%s, generation %d) could not be put in routing: %s; it stays out of routing until "
                  "its node reports it again, the other replicas are unaffected", assignment.replica_id,
                  assignment.model, assignment.generation, failure, exc_info=exc)

    def _add(self, assignment: Assignment, report: wire.ShardReport, api_key: str | None) -> None:
        if self.replicas.model(assignment.model) is None:
            return  # the model was removed by a reload; the assignment is about to retire
        replica = Replica(name=assignment.replica_id, model=assignment.model, url=report.endpoint, api_key=api_key,
                          gauges=self.gauges.get(assignment.model, VLLM_GAUGES),
                          prefill_tokens_per_s=self.prefill_rates.get(assignment.profile),
                          priority_scheduling=assignment.profile in self.priority_profiles,
                          labels={"node": assignment.leader.node_id, "profile": assignment.profile,
                                  "generation": str(assignment.generation)},
                          engine_id=f"{assignment.replica_id}/g{assignment.generation}/pid{report.pid}"
                                    f"/{report.started_at:.3f}")
        self.replicas.add(replica, DEPLOYED)  # plain HTTP: no TLS files that could fail
        self.routed[assignment.replica_id] = Routed(assignment.key, replica)
        log.info("replica %s (%s) enters routing at %s: shard %s is ready", assignment.replica_id, assignment.model,
                 report.endpoint, report.shard_id)

    def _remove(self, routed: Routed, why: str) -> None:
        del self.routed[routed.replica.name]
        log.info("replica %s leaves routing: %s", routed.replica.name, why)
        self.spawn(self.replicas.remove, routed.replica)

    def _retire(self, assignment: Assignment) -> None:
        if assignment.released:
            return
        current = self.routed.get(assignment.replica_id)
        if current is None or current.key != assignment.key:
            self.on_released(assignment.key)
            return
        if not current.draining:
            current.draining = True
            self.spawn(self._drain, current, assignment.retiring)

    async def _drain(self, routed: Routed, reason: str) -> None:
        await self.replicas.drain(routed.replica, reason, self.drain_timeout)
        if self.routed.get(routed.replica.name) is routed:
            del self.routed[routed.replica.name]
        self.on_released(routed.key)

    def replica(self, replica_id: str, key: str) -> Replica | None:
        routed = self.routed.get(replica_id)
        return routed.replica if routed is not None and routed.key == key else None
