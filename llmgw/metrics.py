"""Prometheus metrics of one gateway process (``llmgw_*``), in a registry of its own.

Label children that are hit per request are bound once per replica (see
:meth:`Metrics.for_replica`), since ``.labels()`` costs a few microseconds.
Render with :func:`render`, in a worker thread: ``generate_latest`` is
synchronous and can take a while with many series.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

disable_created_metrics()  # the *_created series double the exposition and nobody alerts on them

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


@dataclass
class ReplicaMetrics:
    inflight: Gauge
    up: Gauge


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("llmgw_requests", "Requests answered on the OpenAI endpoint, by model and HTTP status.",
                                ["model", "code"], registry=r)
        self.request_duration = Histogram("llmgw_request_duration_seconds",
                                          "Time from a request's arrival to the end of its response.",
                                          ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.ttfb = Histogram("llmgw_time_to_first_byte_seconds",
                              "Time from a request's arrival to the first response byte from the engine.",
                              ["model"], buckets=LATENCY_BUCKETS, registry=r)
        self.inflight = Gauge("llmgw_inflight_requests", "Requests in flight per replica.", ["replica"], registry=r)
        self.upstream_errors = Counter("llmgw_upstream_errors", "Failed attempts towards a replica, by kind "
                                       "(connect, timeout, closed, protocol, status_5xx).", ["replica", "kind"],
                                       registry=r)
        self.replica_up = Gauge("llmgw_replica_up", "1 when the replica is routable, else 0.", ["replica"], registry=r)
        self.decisions = Counter("llmgw_prefix_decisions", "Routing decisions by model, tier and outcome.",
                                 ["model", "tier", "outcome"], registry=r)
        self.retries = Counter("llmgw_retries", "Requests sent again to another replica before the first byte.",
                               ["model"], registry=r)
        self.client_disconnects = Counter("llmgw_client_disconnects",
                                          "Requests whose client went away before the response ended.", ["model"],
                                          registry=r)
        self.health_probes = Counter("llmgw_health_probes", "Active health probes by replica and result.",
                                     ["replica", "result"], registry=r)
        self._replicas: dict[str, ReplicaMetrics] = {}

    def for_replica(self, name: str) -> ReplicaMetrics:
        bound = self._replicas.get(name)
        if bound is None:
            bound = self._replicas[name] = ReplicaMetrics(self.inflight.labels(name), self.replica_up.labels(name))
        return bound

    def forget_replica(self, name: str) -> None:
        if self._replicas.pop(name, None) is not None:
            for metric in (self.inflight, self.replica_up):
                try:
                    metric.remove(name)
                except KeyError:
                    pass


async def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The exposition text of ``registry``, rendered in a worker thread (Trio's default, bounded limiter)."""
    body = await trio.to_thread.run_sync(generate_latest, registry)
    return body, CONTENT_TYPE_LATEST
