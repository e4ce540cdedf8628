"""The ``round_robin`` routing tier: each model's replicas in turn, skipping any that are not routable."""

from __future__ import annotations

from typing import Sequence

from ..plugin import Decision, Replica, RouteRequest, RoutingTier, TierModel, TierServices, hookimpl


class RoundRobinTier(RoutingTier):
    name = "round_robin"

    def __init__(self, model: TierModel | None = None, services: TierServices | None = None):
        self._next = 0

    async def pick(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision:
        index = self._next % len(candidates)
        self._next = index + 1
        return Decision(candidates[index], outcome="pick", tier=self.name)

    def explain(self, request: RouteRequest, candidates: Sequence[Replica]) -> dict:
        """The replica the next pick would take, without taking the turn."""
        return {"pick": candidates[self._next % len(candidates)].name, "outcome": "pick",
                "reason": "next in turn", "replicas": [{"name": r.name, "candidate": True} for r in candidates]}


@hookimpl
def register_routing_tiers():
    return {"round_robin": RoundRobinTier}
