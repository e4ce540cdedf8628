"""A band's drain rate at this gateway from what the other gateways measured, before this gateway measures its own.

Behind a balancer, each of N gateways sees a part of the arrivals, so each measures its queue's drain (and trusts
it, :attr:`~.drain.DrainRate.trusted`) later than one gateway would: until then it cannot shed early nor give a
Retry-After from the rate, and its refusals are the slow kind (a waiter's deadline passing). The others' load
reports carry the rate each trusts per band (llmgw/cluster/load.py, ``f``); while this gateway has none of its own,
its rate is their mean times the gateways, times its share of the room: the room splits among the gateways by the
requests each holds (llmgw/flow/room.py ``demand_share``), so a gateway holding a third of what the cluster holds
drains at a third of the cluster's rate. The cluster layer is reached through :class:`PeerDrains` (the gateway
passes it in): the flow layer does not import it.
"""

from __future__ import annotations

from typing import Protocol


class PeerDrains(Protocol):
    """What the queue needs of the other gateways' reports (the gateway adapts llmgw.cluster.load.LoadSharing)."""

    def rates(self, model: str, rank: int) -> list[int]:
        """The drain rate (tokens/s) each live peer trusts for ``model``'s band ``rank`` (peers without one left
        out)."""
        ...

    def held(self, model: str) -> list[int]:
        """The requests each live peer holds for ``model``."""
        ...


def share_of_cluster(rates: list[int], peers_held: int, held: int) -> float | None:
    """This gateway's drain rate (tokens/s) from the peers' ``rates`` for a band: the cluster's (their mean times
    the gateways, this one included) times this gateway's share of what every gateway holds (``held`` here, at
    least the request asking; ``peers_held`` there). None while no peer has one."""
    if not rates:
        return None
    cluster = sum(rates) / len(rates) * (len(rates) + 1)
    mine = max(1, held)
    return cluster * mine / (mine + max(0, peers_held))
