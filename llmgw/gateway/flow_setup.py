"""A gateway's overload control, built from its config: the room (learnt from the engines, shared through the
cluster's load reports), the queue over it, and the data plane's :class:`~.flow_gate.FlowGate`; the queue's task;
a reload.

The room and the queue live as long as the process (the requests waiting, the capacities learnt must outlive a
reload); a reload swaps the gate whole and hands the new settings to both. The ``--workers`` mode and a cluster's
gateways run the same: their room reads the other processes' in-flight and held requests from the load reports
(``sharing``: the shared state's :class:`~llmgw.cluster.load.LoadSharing`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import CollectorRegistry

from ..cluster.load import LoadSharing
from ..config import Config
from ..flow.capacity import UNBOUNDED, CapacityRule
from ..flow.metrics import FlowMetrics
from ..flow.queue import FlowQueue
from ..flow.room import EngineRoom, SharedQueues
from ..flow.room_metrics import RoomMetrics
from ..router.router import EngineMetricsDemand, Router
from ..tenancy.estimate import Estimator
from ..tenancy.model import PriceList
from .explain_shared import SharedOutcomes
from .flow_gate import FlowGate, FlowOutcomes
from .load_figures import PeerDrainsOf
from .tenancy_setup import context_lengths

if TYPE_CHECKING:
    from ..config.schema import FlowConfig


SCRAPE_TIMEOUT = 1.0  # seconds: one scrape of an engine's /metrics for the room


def capacity_rule(flow: FlowConfig) -> CapacityRule:
    return dataclasses.replace(CapacityRule(), kv_high=flow.kv_high, kv_target=flow.kv_target)


def estimator(config: Config) -> Estimator:
    """A request's tokens as the queue counts them: the tenancy's estimate of the same config (prices aside)."""
    return Estimator(config.tenancy.settings(), PriceList(), context_lengths(config))


class GatewayFlow:
    """What one gateway process runs of overload control (``Gateway.flow``); ``gate`` is what its data plane reads."""

    def __init__(self, config: Config, router: Router, registry: CollectorRegistry,
                 sharing: SharedQueues | None = None, explained: SharedOutcomes | None = None) -> None:
        """``explained``: the other gateways' overload decisions and this one's, in the shared state (None: this
        process's alone)."""
        flow = config.flow
        settings = flow.settings()
        self.router = router
        self.room = EngineRoom(router, sharing, settings, capacity_rule(flow), scrape_interval=flow.scrape_interval,
                               scrape_timeout=SCRAPE_TIMEOUT, metrics=RoomMetrics(registry))
        self._scrape(flow)
        router.set_output_quantile(flow.reserved_output_quantile())
        # Among gateways, a band this one has not measured yet drains at its share of the others' rates.
        self.queue = FlowQueue(settings, self.room, FlowMetrics(registry),
                               PeerDrainsOf(sharing) if isinstance(sharing, LoadSharing) else None)
        self.room.count_queued(self.held)
        self.outcomes = FlowOutcomes()
        self.explained = explained
        if explained is not None:
            self.outcomes.shared = explained.note
        self.gate = FlowGate(settings, self.queue, self.room, self.outcomes, estimator(config))

    def held(self, model: str) -> int:
        """The requests the queue holds for ``model``, all classes (what the load report tells the peers)."""
        return sum(queued.requests for queued in self.queue.queued(model).values())

    def apply(self, config: Config) -> FlowGate:
        """A reload's ``flow`` section: the new gate (the caller hands it to the data plane). Requests waiting keep
        their class and place; the new classes, bounds and room knobs apply from the next request and scrape."""
        flow = config.flow
        settings = flow.settings()
        self.queue.settings = settings
        self.room.settings = settings
        self.room.rule = capacity_rule(flow)
        self.room.scrape_interval = flow.scrape_interval
        self._scrape(flow)
        self.router.set_output_quantile(flow.reserved_output_quantile())
        self.gate = FlowGate(settings, self.queue, self.room, self.outcomes, estimator(config))
        return self.gate

    def _scrape(self, flow: FlowConfig) -> None:
        """Every model's engines scraped every ``scrape_interval`` while flow control is on (the room learns from
        them); off, only as their tiers ask."""
        self.router.engine_metrics_demand = EngineMetricsDemand(flow.scrape_interval, SCRAPE_TIMEOUT) \
            if flow.enabled else None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The queue's dispatchers' nursery (and the writer of its decisions to the shared state), in the
        gateway's, started before the first request."""
        async with trio.open_nursery() as nursery:
            if self.explained is not None:
                await nursery.start(self.explained.run)
            await nursery.start(self.queue.run)
            task_status.started()

    async def outcome(self, request_id: str) -> dict[str, Any] | None:
        """``GET /admin/explain?request_id=``: what overload control did with the request here, else at the
        gateway that handled it (from the shared state); None when neither knows it.
        :class:`~llmgw.cluster.link.Unavailable` when the shared state did not answer."""
        outcome = self.outcomes.get(request_id)
        if outcome is not None:
            return outcome.to_json()
        if self.explained is None:
            return None
        return await self.explained.find(request_id)

    def status(self) -> dict[str, Any]:
        """The queues and the room, per model (the status page's and ``GET /admin/flow``'s JSON)."""
        gate = self.gate
        snapshot = self.queue.snapshot()
        models = []
        for model in sorted(self.router.models):
            queue = snapshot.get(model, {})
            room = self.room.describe(model)
            classes = queue.get("classes", {})
            models.append({
                "model": model, "saturation": room["saturation"], "drain_tokens_per_s": queue.get("drain_rate"),
                "dispatching": queue.get("pending", 0), "held_by_peers": room["peers_held"],
                "classes": [{"class": c.name, "rank": c.rank, "free": _finite(self.room.free(model, c)),
                             **_class_figures(classes.get(c.name))} for c in gate.settings.classes],
                "replicas": room["replicas"]})
        return {"enabled": gate.control is not None, "models": models,
                "recent": [outcome.to_json() for outcome in self.outcomes.recent(50)]}

    def overloaded(self) -> list[dict[str, Any]]:
        """The models whose queue shed requests in the last minute, with how many and why (``/health``'s
        ``overloaded``: a truth to tell, not a reason to be unready: the gateway serves what the engines can take)."""
        shed = []
        for model, queue in sorted(self.queue.snapshot().items()):
            reasons: dict[str, int] = {}
            for figures in queue.get("classes", {}).values():
                for reason, count in figures.get("recent_sheds", {}).items():
                    reasons[reason] = reasons.get(reason, 0) + count
            if reasons:
                shed.append({"model": model, "shed_last_minute": reasons,
                             "saturation": round(self.room.saturation(model), 3)})
        return shed

    def explain(self, model: str) -> dict[str, Any]:
        """``POST /admin/explain``'s ``flow`` section: the model's queue and room now."""
        for entry in self.status()["models"]:
            if entry["model"] == model:
                return {"enabled": self.gate.control is not None, **entry}
        return {"enabled": self.gate.control is not None, "model": model}


def _class_figures(figures: dict[str, Any] | None) -> dict[str, Any]:
    figures = figures or {}
    return {"queued": figures.get("queued", 0), "queued_tokens": figures.get("queued_tokens", 0),
            "oldest_wait_s": round(figures.get("oldest_wait", 0.0), 3), "recent_sheds": figures.get("recent_sheds", {})}


def _finite(free: int) -> int | None:
    """The room's free requests, None for unbounded (no capacity learnt yet: nothing is held)."""
    return None if free >= UNBOUNDED else free
