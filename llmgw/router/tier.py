"""What a routing tier is: the interface every tier plugin implements.

A tier is built per model by the factory its plugin registers
(``register_routing_tiers``) and asked, per request, to pick one of the
model's routable replicas. Tiers may keep state (a prefix tree, a KV index)
and learn from :meth:`RoutingTier.routed` and :meth:`RoutingTier.finished`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

from .replica import Replica


@dataclass(slots=True)
class RouteRequest:
    """What a tier may look at: the model, the API path and the parsed JSON body."""

    model: str
    path: str
    body: dict[str, Any]
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    request_id: str = ""


@dataclass(slots=True)
class Decision:
    """A tier's pick. ``outcome`` labels ``llmgw_prefix_decisions_total`` (e.g. hit, miss, load_override)."""

    replica: Replica
    outcome: str = "pick"
    tier: str = ""
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class TierServices:
    """What the router offers tiers: the plugin registry, metrics, and the model's replica list."""

    registry: Any = None
    metrics: Any = None
    replicas: Sequence[Replica] = ()


class RoutingTier(Protocol):
    name: str

    async def pick(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision | None:
        """Pick one of ``candidates`` (routable, not yet tried for this request; never empty).

        Return None to defer to the next tier of the fallback chain.
        """

    def routed(self, request: RouteRequest, decision: Decision) -> None:
        """Called once the request was handed to ``decision.replica``."""

    def finished(self, request: RouteRequest, decision: Decision, usage: dict | None) -> None:
        """Called when the response ended; ``usage`` is the engine's usage block when it was seen."""
