"""The replicas of every model in one table, with where each came from and its per-process handles.

Two sources feed a :class:`ReplicaSet`: ``static`` (the config's ``models``) and
``deployed`` (profiles the control plane placed on agents' nodes). Each source
declares the models it serves (:meth:`ReplicaSet.declare_model`) and adds,
drains and removes its own replicas; the router builds one route per declared
model (it watches the declarations) and reads each model's replicas from here
(:meth:`ReplicaSet.members`, a live list the set keeps up to date).

Adding a replica gives it its handles in this process: a connection pool, its
``llmgw_replica_up`` series and, when the set has a health tracker, a prober
task (in the nursery :meth:`ReplicaSet.run` owns). Removing it releases them;
draining marks it draining, waits for its in-flight requests, then removes it.

Membership (which replicas and models exist, and their source) is what several
gateways would share; the handles and health are each process's own (see
docs/architecture.md, "Where state lives").
"""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator

import trio

from ..tls import describe_tls_error
from .health import HealthTracker, probe_forever
from .model import TierModel
from .replica import Replica, ReplicaState

if TYPE_CHECKING:
    from ..metrics import Metrics

log = logging.getLogger(__name__)

STATIC = "static"  # the config's `models`
DEPLOYED = "deployed"  # placed by the control plane from `profiles` and `deployments`


@dataclass(eq=False)
class Member:
    replica: Replica
    source: str
    probe: trio.CancelScope | None = None  # its prober's scope, while one runs


class ReplicaSet:
    """Every replica this process routes to, by model, name and source.

    Built without a health tracker, metrics or connect timeout (a bare
    :class:`~llmgw.router.router.Router` in tests and benchmarks) it is only
    the table: adding opens no pool and starts no prober.
    """

    def __init__(self, health: HealthTracker | None = None, metrics: Metrics | None = None,
                 connect_timeout: float | None = None):
        self.health = health
        self.metrics = metrics
        self.connect_timeout = connect_timeout
        self._members: dict[Replica, Member] = {}  # in the order they were added
        self._by_model: dict[str, list[Replica]] = {}  # live lists: route.replicas and TierServices.replicas
        self._declared: dict[str, dict[str, TierModel]] = {}  # model -> source -> what it declared
        self._effective: dict[str, TierModel] = {}  # model -> the declaration its route is built with
        self._watchers: list[Callable[[str], None]] = []
        self._member_watchers: list[Callable[[Replica], None]] = []
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Own the probers of the replicas added while it runs."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    # -- models --------------------------------------------------------------------------------------------------

    def watch_models(self, watcher: Callable[[str], None]) -> None:
        """Call ``watcher(model name)`` whenever that model's declarations change (see :meth:`model`)."""
        self._watchers.append(watcher)

    def watch_members(self, watcher: Callable[[Replica], None]) -> None:
        """Call ``watcher(replica)`` whenever a replica is added to the table or taken out of it."""
        self._member_watchers.append(watcher)

    def declare_model(self, source: str, model: TierModel) -> None:
        """``source`` serves ``model``. A declaration that differs from this source's previous one becomes the
        model's effective one (its route is rebuilt with it); the same one again changes nothing."""
        declared = self._declared.setdefault(model.name, {})
        if declared.get(source) == model:
            return
        declared[source] = model
        self._effective[model.name] = model
        self._changed(model.name)

    def withdraw_model(self, source: str, name: str) -> bool:
        """``source`` no longer serves ``name``; True when no source does any more (its route goes)."""
        declared = self._declared.get(name)
        if declared is None or declared.pop(source, None) is None:
            return False
        if not declared:
            del self._declared[name]
            del self._effective[name]
        self._changed(name)  # the adapters may change even when another source keeps the model
        return name not in self._declared

    def model(self, name: str) -> TierModel | None:
        """The model's effective declaration (the one changed last; kept when another source withdraws), or None
        when no source declares it."""
        return self._effective.get(name)

    def adapters(self, name: str) -> list[str]:
        """The LoRA adapters of ``name``: those every declaring source lists."""
        names: dict[str, None] = {}
        for model in self._declared.get(name, {}).values():
            names.update((adapter.name, None) for adapter in model.lora_adapters)
        return list(names)

    def declared_models(self) -> list[str]:
        return list(self._declared)

    def declarations(self) -> list[tuple[str, TierModel]]:
        """Every ``(source, model)`` declaration (what a snapshot of the shared state holds)."""
        return [(source, model) for declared in self._declared.values() for source, model in declared.items()]

    def _changed(self, name: str) -> None:
        for watcher in self._watchers:
            watcher(name)

    # -- lookups -------------------------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Replica]:
        return iter(list(self._members))

    def __contains__(self, replica: Replica) -> bool:
        return replica in self._members

    def members(self, model: str) -> list[Replica]:
        """The replicas of ``model``: a live list (the same object for the set's lifetime, changed in place)."""
        return self._by_model.setdefault(model, [])

    def get(self, name: str) -> Replica | None:
        """The replica named ``name`` (the newest, while a previous one of that name still drains)."""
        found = None
        for replica in self._members:
            if replica.name == name:
                found = replica
        return found

    def model_of(self, name: str) -> str:
        """The model replica ``name`` serves ("" when there is no such replica)."""
        replica = self.get(name)
        return replica.model if replica is not None else ""

    def source_of(self, replica: Replica) -> str | None:
        member = self._members.get(replica)
        return member.source if member is not None else None

    def of_source(self, source: str) -> list[Replica]:
        return [m.replica for m in self._members.values() if m.source == source]

    def describe(self, replica: Replica) -> dict[str, Any]:
        """The replica's JSON for ``/admin/replicas``, with its ``source``."""
        return {**replica.as_json(), "source": self.source_of(replica)}

    # -- lifecycle -----------------------------------------------------------------------------------------------

    def add(self, replica: Replica, source: str = STATIC) -> bool:
        """Put a replica into the set (and so into routing) with its handles; False (logged) when its TLS files
        cannot be used."""
        if self.connect_timeout is not None and replica.pool is None:
            try:
                replica.pool = replica.open_pool(self.connect_timeout)
            except (OSError, ssl.SSLError) as exc:  # the files changed since the config was checked
                log.error("replica %s (%s) is not routed: its TLS settings cannot be used: %s", replica.name,
                          replica.url, describe_tls_error(exc))
                return False
        member = Member(replica, source)
        self._members[replica] = member
        model = self.members(replica.model)
        if replica not in model:
            model.append(replica)
        if self.metrics is not None:
            self.metrics.for_replica(replica).up.set(1 if replica.routable else 0)
        if self.health is not None:
            assert self._nursery is not None, "ReplicaSet.run is not running"
            member.probe = trio.CancelScope()
            self._nursery.start_soon(self._probe, replica, self.health, member.probe)
        self._members_changed(replica)
        return True

    def discard(self, replica: Replica) -> None:
        """Take ``replica`` out of the table (and routing) at once; its handles are :meth:`remove`'s business."""
        member = self._members.pop(replica, None)
        if member is not None and member.probe is not None:
            member.probe.cancel()
        model = self._by_model.get(replica.model)
        if model is not None and replica in model:
            model.remove(replica)
        if member is not None:
            self._members_changed(replica)

    def _members_changed(self, replica: Replica) -> None:
        for watcher in self._member_watchers:
            watcher(replica)

    async def remove(self, replica: Replica) -> None:
        """Take ``replica`` out and release its handles: prober, health counts, metric series, pool."""
        self.discard(replica)
        if self.health is not None:
            self.health.forget(replica)
        if self.metrics is not None:
            self.metrics.forget_replica(replica)
        if replica.pool is not None:
            await replica.pool.aclose()

    async def drain(self, replica: Replica, reason: str, timeout: float) -> None:
        """Take a replica out of routing without cutting a request: no new ones, in-flight ones finish (up to
        ``timeout``), then it is removed.

        It waits for the cluster's ``inflight``, not only this process's: other gateways may still have
        requests there. A peer's figure may be stale (a gateway that died keeps its last one until the sharing
        code expires it), which ``timeout`` bounds like any other wait."""
        if self.health is not None:
            self.health.set_state(replica, ReplicaState.DRAINING, reason)
        else:
            replica.state, replica.reason = ReplicaState.DRAINING, reason
        with trio.move_on_after(timeout) as waited:
            while replica.inflight > 0:  # ours plus the peers' latest
                await trio.sleep(0.05)
        if waited.cancelled_caught:
            log.warning("replica %s: %d requests still in flight (%d of them from other gateways) after %gs of "
                        "draining; removing it anyway", replica.name, replica.inflight, replica.peer_inflight, timeout)
        await self.remove(replica)

    async def _probe(self, replica: Replica, health: HealthTracker, scope: trio.CancelScope) -> None:
        with scope:
            await probe_forever(replica, health)
