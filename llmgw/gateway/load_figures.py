"""What a gateway tells the others per model in its load report (``f``, llmgw/cluster/records.py ``ModelFigures``),
and the others' figures as its flow queue reads them.

Per model: the requests that entered its flow queue (a counter: the leader's autoscaler sums the cluster's
arrivals), its first tokens of the last minute within the deployment's ``ttft_slo`` and in all (the cluster's TTFT
attainment), the output allowance of its requests in flight (the room counts the others' output at their mean,
not this gateway's), and the drain rate it trusts per band (a gateway that has not measured its own yet sheds and
answers Retry-After on its share of the cluster's: llmgw/flow/cluster_drain.py). Only models with something to
say are listed: a report stays a few dozen bytes per model served.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import trio

from ..cluster.records import ModelFigures

if TYPE_CHECKING:
    from ..autoscale.signals import FirstTokens
    from ..cluster.load import LoadSharing
    from ..flow.queue import FlowQueue
    from ..router.router import Router


class GatewayFigures:
    """This gateway's figures per model (the source its load sharing reports, :meth:`own`)."""

    def __init__(self, router: "Router", queue: "FlowQueue", first_tokens: "FirstTokens",
                 slo_of: Callable[[str], float | None]):
        self.router = router
        self.queue = queue
        self.first_tokens = first_tokens
        self.slo_of = slo_of

    def own(self) -> dict[str, ModelFigures]:
        now = trio.current_time()
        figures = {}
        for name, route in list(self.router.models.items()):
            slo = self.slo_of(name)
            within, seen = self.first_tokens.counts(name, slo, now) if slo is not None else (0, 0)
            found = ModelFigures(self.queue.entered(name), within, seen,
                                 sum(replica.local_inflight_output_tokens for replica in route.replicas),
                                 self.queue.trusted_drains(name))
            if any(found[:4]) or found.drains:
                figures[name] = found
        return figures


class PeerDrainsOf:
    """The other gateways' drain rates and held requests, for the flow queue (llmgw/flow/cluster_drain.py)."""

    def __init__(self, sharing: "LoadSharing"):
        self.sharing = sharing

    def rates(self, model: str, rank: int) -> list[int]:
        return [rate for figures in self.sharing.peer_figures(model).values()
                for band, rate in figures.drains if band == rank and rate > 0]

    def held(self, model: str) -> list[int]:
        return self.sharing.peer_queued(model)
