"""The router: per model, the replicas and the routing tier that picks among them.

Tiers are built from plugin factories once, when a model is configured. A
tier that defers (returns None) or fails falls back to round-robin, so a
broken third-party tier never stops traffic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Iterable

from .replica import Replica
from .tier import Decision, RouteRequest, RoutingTier, TierServices

log = logging.getLogger(__name__)


@dataclass
class ModelRoute:
    name: str
    tier_name: str
    tier: RoutingTier
    fallback: RoutingTier
    replicas: list[Replica] = field(default_factory=list)
    options: dict[str, Any] = field(default_factory=dict)


class Router:
    def __init__(self, registry, metrics=None):
        self.registry = registry
        self.metrics = metrics
        self.models: dict[str, ModelRoute] = {}
        self._tier_errors_logged: set[str] = set()

    def configure_model(self, name: str, tier_name: str, options: dict | None = None, model_config=None) -> ModelRoute:
        """Create or re-tier a model; its replicas are kept."""
        existing = self.models.get(name)
        replicas = existing.replicas if existing else []
        services = TierServices(registry=self.registry, metrics=self.metrics, replicas=replicas)
        tier = self.registry.get("routing_tiers", tier_name)(model_config, services)
        fallback = self.registry.get("routing_tiers", "round_robin")(model_config, services)
        route = ModelRoute(name, tier_name, tier, fallback, replicas, dict(options or {}))
        self.models[name] = route
        return route

    def add_replica(self, replica: Replica) -> None:
        route = self.models[replica.model]
        if replica not in route.replicas:
            route.replicas.append(replica)

    def remove_replica(self, replica: Replica) -> None:
        route = self.models.get(replica.model)
        if route and replica in route.replicas:
            route.replicas.remove(replica)

    def remove_model(self, name: str) -> None:
        self.models.pop(name, None)

    def all_replicas(self) -> Iterable[Replica]:
        for route in self.models.values():
            yield from route.replicas

    def candidates(self, model: str, exclude: Iterable[Replica] = ()) -> list[Replica]:
        route = self.models[model]
        excluded = set(exclude)
        return [r for r in route.replicas if r.routable and r not in excluded]

    async def pick(self, request: RouteRequest, exclude: Iterable[Replica] = ()) -> Decision | None:
        """A routable replica for ``request`` not in ``exclude``, or None when there is none."""
        route = self.models[request.model]
        candidates = self.candidates(request.model, exclude)
        if not candidates:
            return None
        decision = None
        try:
            decision = await route.tier.pick(request, candidates)
        except Exception:
            if route.tier_name not in self._tier_errors_logged:
                self._tier_errors_logged.add(route.tier_name)
                log.exception("routing tier %r failed; falling back to round_robin (logged once)", route.tier_name)
            if self.metrics is not None:
                self.metrics.decisions.labels(request.model, route.tier_name, "error").inc()
        if decision is None or decision.replica not in candidates:
            decision = await route.fallback.pick(request, candidates)
            decision.outcome = "fallback"
        if self.metrics is not None:
            self.metrics.decisions.labels(request.model, decision.tier or route.tier_name, decision.outcome).inc()
        return decision

    def routed(self, request: RouteRequest, decision: Decision) -> None:
        route = self.models.get(request.model)
        if route is not None:
            self._notify(route, "routed", request, decision)

    def finished(self, request: RouteRequest, decision: Decision, usage: dict | None) -> None:
        route = self.models.get(request.model)
        if route is not None:
            self._notify(route, "finished", request, decision, usage)

    def _notify(self, route: ModelRoute, hook: str, *args) -> None:
        try:
            getattr(route.tier, hook)(*args)
        except Exception:
            key = f"{route.tier_name}.{hook}"
            if key not in self._tier_errors_logged:
                self._tier_errors_logged.add(key)
                log.exception("routing tier %r failed in %s (logged once)", route.tier_name, hook)
