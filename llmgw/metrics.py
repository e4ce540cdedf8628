"""Prometheus metrics of one gateway process (``llmgw_*``), in a registry of its own.

Label children that are hit per request are bound once (see
:meth:`Metrics.for_replica` and :meth:`Metrics.for_model`), since
prometheus-client's ``.labels()`` costs a few microseconds. Every labelled
metric here is also wrapped in :class:`CachedLabels`, so that a repeated
``.labels()`` call with the same values is one dictionary lookup. Render with
:func:`render`, in a worker thread: ``generate_latest`` is synchronous and can
take a while with many series.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

disable_created_metrics()  # the *_created series double the exposition and nobody alerts on them

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class CachedLabels:
    """A labelled metric whose children are kept per label values: ``.labels(*values)`` is a dict lookup.

    Anything else (``collect``, ``describe``, ...) is the wrapped metric's; ``remove`` and
    ``clear`` also forget the cached children. The wrapped metric is ``.metric``.
    """

    __slots__ = ("metric", "_children")

    def __init__(self, metric):
        self.metric = metric
        self._children: dict[tuple, object] = {}

    def labels(self, *values, **labelkwargs):
        if labelkwargs:
            return self.metric.labels(*values, **labelkwargs)
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self.metric.labels(*values)
        return child

    def remove(self, *values) -> None:
        wanted = tuple(str(v) for v in values)
        self._children = {k: v for k, v in self._children.items() if tuple(str(x) for x in k) != wanted}
        self.metric.remove(*values)

    def clear(self) -> None:
        self._children.clear()
        self.metric.clear()

    def __getattr__(self, name):
        return getattr(self.metric, name)


@dataclass
class ReplicaMetrics:
    inflight: Gauge
    up: Gauge
    inflight_of: object = None  # the object whose ``inflight`` attribute the gauge reads (see track_inflight)

    def track_inflight(self, source) -> None:
        """Make ``llmgw_inflight_requests`` read ``source.inflight`` when scraped, instead of being
        incremented and decremented per request (two locked updates saved per request)."""
        self.inflight_of = source
        self.inflight.set_function(lambda: source.inflight)


class ModelMetrics:
    """The per-model children the data plane touches on every request, bound once per model."""

    __slots__ = ("model", "_requests", "_by_code", "request_duration", "ttfb", "retries", "client_disconnects")

    def __init__(self, metrics: "Metrics", model: str):
        self.model = model
        self._requests = metrics.requests
        self._by_code: dict[int, Counter] = {}
        self.request_duration = metrics.request_duration.labels(model)
        self.ttfb = metrics.ttfb.labels(model)
        self.retries = metrics.retries.labels(model)
        self.client_disconnects = metrics.client_disconnects.labels(model)

    def requests(self, code: int) -> Counter:
        """The ``llmgw_requests_total{model,code}`` child for HTTP status ``code``."""
        child = self._by_code.get(code)
        if child is None:
            child = self._by_code[code] = self._requests.labels(self.model, str(code))
        return child


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = CachedLabels(Counter(
            "llmgw_requests", "Requests answered on the OpenAI endpoint, by model and HTTP status.",
            ["model", "code"], registry=r))
        self.request_duration = CachedLabels(Histogram(
            "llmgw_request_duration_seconds", "Time from a request's arrival to the end of its response.",
            ["model"], buckets=LATENCY_BUCKETS, registry=r))
        self.ttfb = CachedLabels(Histogram(
            "llmgw_time_to_first_byte_seconds",
            "Time from a request's arrival to the first response byte from the engine.",
            ["model"], buckets=LATENCY_BUCKETS, registry=r))
        self.inflight = CachedLabels(Gauge(
            "llmgw_inflight_requests", "Requests in flight per replica.", ["replica"], registry=r))
        self.upstream_errors = CachedLabels(Counter(
            "llmgw_upstream_errors", "Failed attempts towards a replica, by kind "
            "(connect, tls, timeout, closed, protocol, status_5xx).", ["replica", "kind"], registry=r))
        self.replica_up = CachedLabels(Gauge(
            "llmgw_replica_up", "1 when the replica is routable, else 0.", ["replica"], registry=r))
        self.decisions = CachedLabels(Counter(
            "llmgw_prefix_decisions", "Routing decisions by model, tier and outcome.",
            ["model", "tier", "outcome"], registry=r))
        self.retries = CachedLabels(Counter(
            "llmgw_retries", "Requests sent again to another replica before the first byte.", ["model"],
            registry=r))
        self.client_disconnects = CachedLabels(Counter(
            "llmgw_client_disconnects", "Requests whose client went away before the response ended.", ["model"],
            registry=r))
        self.health_probes = CachedLabels(Counter(
            "llmgw_health_probes", "Active health probes by replica and result.", ["replica", "result"],
            registry=r))
        self.tls_handshake_failures = CachedLabels(Counter(
            "llmgw_tls_handshake_failures", "Client connections closed because their TLS handshake failed or "
            "timed out, by listener.", ["listener"], registry=r))
        self._replicas: dict[str, ReplicaMetrics] = {}
        self._models: dict[str, ModelMetrics] = {}

    def for_replica(self, name: str) -> ReplicaMetrics:
        bound = self._replicas.get(name)
        if bound is None:
            bound = self._replicas[name] = ReplicaMetrics(self.inflight.labels(name), self.replica_up.labels(name))
        return bound

    def for_model(self, name: str) -> ModelMetrics:
        """The children of the per-model series, bound once (model names are configured, so bounded)."""
        bound = self._models.get(name)
        if bound is None:
            bound = self._models[name] = ModelMetrics(self, name)
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
