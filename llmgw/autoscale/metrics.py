"""The autoscaler's metrics (``llmgw_autoscale_*``) and its one log line per decision, on the gateway's registry.

The leader's loop calls :meth:`AutoscaleMetrics.record` with each call's decisions (counted, and logged once as
``autoscale: ...``) and :meth:`AutoscaleMetrics.observe` with the views it decided on (the replica gauges and
the age of each deployment's last decision). docs/metrics.md lists the series.
"""

from __future__ import annotations

import logging
from typing import Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from ..metrics import one_per_registry
from .model import DeploymentView, ScaleDecision
from .scaler import change_of

log = logging.getLogger("llmgw.autoscale")


def describe(decision: ScaleDecision) -> str:
    """The decision as one line: ``chat up 2 -> 5: 20 requests queued ... for 5.0 s: 2 -> 5 replicas``."""
    return f"{decision.key} ({decision.model}) {change_of(decision)}: {decision.reason}"


class AutoscaleMetrics:
    @classmethod
    def for_registry(cls, registry: CollectorRegistry) -> "AutoscaleMetrics":
        """The one instance of ``registry`` (a leader builds its scaler loop again for every term it leads)."""
        return one_per_registry(cls, registry)

    def __init__(self, registry: CollectorRegistry):
        labels = ["deployment"]
        self.desired = Gauge("llmgw_autoscale_desired_replicas", "Replicas the autoscaler wants an autoscaled "
                             "deployment (a profile) to run.", labels, registry=registry)
        self.ready = Gauge("llmgw_autoscale_ready_replicas", "Replicas of an autoscaled deployment ready and "
                           "routed.", labels, registry=registry)
        self.starting = Gauge("llmgw_autoscale_starting_replicas", "Replicas of an autoscaled deployment placed and "
                              "starting, not ready yet (they count toward its capacity).", labels, registry=registry)
        self.decisions = Counter("llmgw_autoscale_decisions", "Autoscaler decisions, by deployment and kind (up, "
                                 "down, from_zero, to_zero, take, give, hold).", ["deployment", "kind"],
                                 registry=registry)
        self.sleeping = Gauge("llmgw_autoscale_sleeping_replicas", "Replicas of an autoscaled deployment scaled "
                              "down and kept warm asleep (engine sleep mode): a step up wakes one instead of a cold "
                              "start.", labels, registry=registry)
        self.busy = Gauge("llmgw_autoscale_busy_replicas", "The ready replicas' busy engine seats of an autoscaled "
                          "deployment, in replicas (each replica's requests in flight over its seats, at most 1): "
                          "what the utilisation target reads; absent until an engine's seats are learnt.", labels,
                          registry=registry)
        self.last_decision_age = Gauge("llmgw_autoscale_last_decision_age_seconds", "Seconds since the last "
                                       "decision about an autoscaled deployment (its reason: /admin/autoscale).",
                                       labels, registry=registry)
        self._last_at: dict[str, float] = {}
        self._shown: set[str] = set()

    def record(self, decisions: Iterable[ScaleDecision]) -> None:
        """Count and log each decision once (a hold at info too: it says why a step waits)."""
        for decision in decisions:
            self.decisions.labels(decision.key, decision.kind).inc()
            self._last_at[decision.key] = decision.at
            log.info("autoscale: %s", describe(decision))

    def observe(self, now: float, views: Sequence[DeploymentView], desired: dict[str, int],
                sleeping: dict[str, int] | None = None) -> None:
        """Set each deployment's gauges (``desired``: the scaler's count for it; ``sleeping``: its replicas kept
        asleep); a deployment gone loses them."""
        keys = {view.key for view in views}
        for gone in self._shown - keys:
            for gauge in (self.desired, self.ready, self.starting, self.sleeping, self.busy, self.last_decision_age):
                try:
                    gauge.remove(gone)
                except KeyError:  # never had that series
                    pass
            self._last_at.pop(gone, None)
        self._shown = keys
        for view in views:
            self.desired.labels(view.key).set(desired.get(view.key, view.desired))
            self.ready.labels(view.key).set(view.counts.ready)
            self.starting.labels(view.key).set(view.counts.starting)
            self.sleeping.labels(view.key).set((sleeping or {}).get(view.key, 0))
            if view.signals.busy is not None:
                self.busy.labels(view.key).set(view.signals.busy)
            if view.key in self._last_at:
                self.last_decision_age.labels(view.key).set(max(0.0, now - self._last_at[view.key]))
