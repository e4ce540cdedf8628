"""The config's ``models`` as replicas: the ``static`` source of the :class:`~llmgw.router.replicas.ReplicaSet`.

:meth:`StaticReplicas.apply` makes the set's static models and replicas those
of a (re)loaded config: new ones are added, changed or unlisted ones drained
(an unlisted one's entries in the KV index go with it), models no longer
listed withdrawn (the route stays while a deployed profile serves the same
model). Static replicas with ``kv_events`` (connect mode) get one KV-event
subscription each, fed into the KV index, restarted when its settings change
and cancelled when the replica goes. The control plane never touches them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import trio

from ..config.tls import replica_tls_options
from ..kv.external import ExternalKv
from ..router.model import TierModel
from ..router.replica import Replica
from ..router.replicas import STATIC
from .interfaces import KvWriter, ReplicaTable
from .tasks import TaskHost

if TYPE_CHECKING:
    from ..config import Config

log = logging.getLogger(__name__)

DRAIN_TIMEOUT = 600.0


class StaticReplicas(TaskHost):
    not_running = "StaticReplicas.run is not running"

    def __init__(self, replicas: ReplicaTable, kv_index: KvWriter, registry, metrics_registry,
                 follow_kv: bool = True):
        """``follow_kv``: subscribe to the static replicas' KV events (not in a ``--role gateway`` process: the
        cluster's log brings their changes)."""
        self.follow_kv = follow_kv
        self.replicas = replicas
        self.kv_index = kv_index
        self.registry = registry
        self.metrics_registry = metrics_registry
        self._static: dict[str, Replica] = {}  # by name
        self._kv: dict[str, tuple[ExternalKv, trio.CancelScope]] = {}  # name -> (subscription, its task's scope)

    def apply(self, config: "Config") -> None:
        """Make the set's static models and replicas those of ``config.models``."""
        wanted: dict[str, Replica] = {}
        for model in config.models:
            self.replicas.declare_model(STATIC, TierModel.of(model.name, model.routing, model.routing_options,
                                                             lora_adapters=model.lora_adapters))
            for index, spec in enumerate(model.replicas):
                name = spec.name or f"{model.name}-{index}"
                wanted[name] = Replica(name=name, model=model.name, url=spec.url, api_key=spec.api_key,
                                       weight=spec.weight, prefill_tokens_per_s=spec.prefill_tokens_per_s,
                                       priority_scheduling=spec.scheduling_policy == "priority",
                                       tls=replica_tls_options(spec, config.upstream_tls))
                if wanted[name].uses_tls and not wanted[name].tls.verify:
                    log.warning("replica %s (%s): TLS certificate and host name verification is OFF "
                                "(tls_verify: false); anyone on the path can read and change its traffic, "
                                "API key included", name, spec.url)
        for name, replica in list(self._static.items()):
            new = wanted.get(name)
            if new is None or (new.model, new.url, new.api_key, new.weight, new.tls, new.priority_scheduling) != (
                    replica.model, replica.url, replica.api_key, replica.weight, replica.tls,
                    replica.priority_scheduling):
                del self._static[name]
                self.spawn(self._drain, replica, "removed from the config", new is None)
        for name, replica in wanted.items():
            if name not in self._static and self.replicas.add(replica, STATIC):
                self._static[name] = replica
        listed = {model.name for model in config.models}
        for declared in self.replicas.declared_models():
            if declared not in listed:
                self.replicas.withdraw_model(STATIC, declared)
        self._follow_kv(config)

    def rejoin(self, config: "Config") -> None:
        """The table behind it starts empty again (a cluster candidate's new term): add every replica anew. The
        KV subscriptions go on as they are."""
        self._static.clear()
        self.apply(config)

    def kv_fed(self) -> list[str]:
        """The static replicas whose KV events this process follows."""
        return list(self._kv)

    async def _drain(self, replica: Replica, reason: str, forget_kv: bool) -> None:
        await self.replicas.drain(replica, reason, DRAIN_TIMEOUT)
        if forget_kv:
            self.kv_index.remove(replica.name)

    def _follow_kv(self, config: "Config") -> None:
        wanted: dict[str, ExternalKv] = {}
        for model in config.models if self.follow_kv else ():
            for index, spec in enumerate(model.replicas):
                name = spec.name or f"{model.name}-{index}"
                follow = ExternalKv.of(name, spec, model.routing_options, model.name)
                if follow is not None:
                    wanted[name] = follow
        for name, (follow, scope) in list(self._kv.items()):
            if wanted.get(name) != follow:
                scope.cancel()
                del self._kv[name]
        for name, follow in wanted.items():
            if name not in self._kv:
                scope = trio.CancelScope()
                self._kv[name] = (follow, scope)
                self.spawn(self._run_kv, follow, scope)

    async def _run_kv(self, follow: ExternalKv, scope: trio.CancelScope) -> None:
        with scope:
            try:
                await follow.run(self.kv_index, self.registry, self.metrics_registry)
            except Exception:
                log.exception("replica %s: following its KV events at %s failed; it is routed without them",
                              follow.replica, follow.events)
