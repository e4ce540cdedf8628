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

import weakref
from typing import Any, Callable, TypeVar

import trio
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .cached_labels import CachedLabels
from .fdpressure import FD_EXHAUSTION

disable_created_metrics()  # the *_created series double the exposition and nobody alerts on them

ANSWERED = "answered"  # llmgw_requests_total's outcome: the answer ended as its status says
STREAM_ERROR = "stream_error"  # a 200 stream the upstream broke off: the client read an error event (or a cut)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5, 5, 10)
TOKEN_LATENCY_BOUNDS = (*TOKEN_LATENCY_BUCKETS, float("inf"))  # a histogram's upper bounds, +Inf last


_Metrics = TypeVar("_Metrics")
_per_registry: "weakref.WeakKeyDictionary[CollectorRegistry, dict[Any, Any]]" = weakref.WeakKeyDictionary()


def one_per_registry(cls: Callable[[CollectorRegistry], _Metrics], registry: CollectorRegistry) -> _Metrics:
    """The one ``cls(registry)`` of ``registry``: a series registers once per registry, and a leader builds its
    control plane (and the autoscaler's loop) again for every term it leads."""
    instances = _per_registry.setdefault(registry, {})
    if cls not in instances:
        instances[cls] = cls(registry)
    return instances[cls]


def add_observations(histogram: Histogram, counts: list[int], total: float) -> None:
    """Add to a histogram child, at once, observations already counted into its buckets: ``counts[i]`` of them
    in bucket ``i`` of its upper bounds (the first bound at least the value, as ``observe`` picks; +Inf last),
    summing to ``total``. The same series as one ``observe`` per value, for one lock per bucket touched.

    prometheus-client has no public call for this; its ``observe`` adds to ``_sum`` and to one of ``_buckets``
    (not cumulative: the exposition adds them up), which is what this does ``counts[i]`` at a time."""
    buckets = histogram._buckets
    for bucket, count in zip(buckets, counts):
        if count:
            bucket.inc(count)
    histogram._sum.inc(total)


class ReplicaMetrics:
    """The per-replica children the data plane touches on every request, bound once per replica."""

    __slots__ = ("inflight", "up", "inflight_of", "ttft", "inter_token", "e2e", "prompt_tokens", "cached_tokens",
                 "completion_tokens")

    def __init__(self, metrics: "Metrics", replica: str, model: str):
        values = (model, replica)
        self.inflight = metrics.inflight.labels(*values)
        self.up = metrics.replica_up.labels(*values)
        self.inflight_of: object = None  # the object whose ``local_inflight`` the gauge reads (see track_inflight)
        self.ttft = metrics.ttft.labels(*values)
        self.inter_token = metrics.inter_token.labels(*values)
        self.e2e = metrics.e2e.labels(*values)
        self.prompt_tokens = metrics.prompt_tokens.labels(*values)
        self.cached_tokens = metrics.cached_tokens.labels(*values)
        self.completion_tokens = metrics.completion_tokens.labels(*values)

    def track_inflight(self, source) -> None:
        """Make ``llmgw_inflight_requests`` read ``source.local_inflight`` when scraped, instead of being
        incremented and decremented per request (two locked updates saved per request).

        This process's own count, not the cluster's ``inflight``: every gateway exports its own series, and
        summing them in Prometheus gives the cluster's (adding peers' figures here would count them twice)."""
        self.inflight_of = source
        self.inflight.set_function(lambda: source.local_inflight)


class ModelMetrics:
    """The per-model children the data plane touches on every request, bound once per model."""

    __slots__ = ("model", "_requests", "_by_code", "request_duration", "ttfb", "retries", "client_disconnects")

    def __init__(self, metrics: "Metrics", model: str):
        self.model = model
        self._requests = metrics.requests
        self._by_code: dict[tuple[int, str], Counter] = {}
        self.request_duration = metrics.request_duration.labels(model)
        self.ttfb = metrics.ttfb.labels(model)
        self.retries = metrics.retries.labels(model)
        self.client_disconnects = metrics.client_disconnects.labels(model)

    def requests(self, code: int, outcome: str = ANSWERED) -> Counter:
        """The ``llmgw_requests_total{model,code,outcome}`` child for HTTP status ``code`` and ``outcome``
        (:data:`ANSWERED`, or :data:`STREAM_ERROR`: a stream the upstream broke off after its head)."""
        child = self._by_code.get((code, outcome))
        if child is None:
            child = self._by_code[(code, outcome)] = self._requests.labels(self.model, str(code), outcome)
        return child


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = CachedLabels(Counter(
            "llmgw_requests", "Requests answered on the OpenAI endpoint, by model, the HTTP status the client saw, "
            "and outcome: answered, or stream_error (the upstream broke off a stream after its head).",
            ["model", "code", "outcome"], registry=r))
        self.requests_by_key = CachedLabels(Counter(
            "llmgw_requests_by_key", "Every answer of the data plane (but /health and /ready), by the name of the "
            "API key it carried (none: no valid key, or no api_keys; api: any key made by the admin API) and HTTP "
            "status.", ["key", "code"],
            registry=r))
        self.request_duration = CachedLabels(Histogram(
            "llmgw_request_duration_seconds", "Time from a request's arrival to the end of its response.",
            ["model"], buckets=LATENCY_BUCKETS, registry=r))
        self.ttfb = CachedLabels(Histogram(
            "llmgw_time_to_first_byte_seconds",
            "Time from a request's arrival to the first response byte from the engine.",
            ["model"], buckets=LATENCY_BUCKETS, registry=r))
        self.inflight = CachedLabels(Gauge(
            "llmgw_inflight_requests", "Requests this gateway has in flight per replica.", ["model", "replica"],
            registry=r))
        self.upstream_errors = CachedLabels(Counter(
            "llmgw_upstream_errors", "Failed attempts that say a replica is unwell, by kind "
            "(connect, closed_before_request, tls, timeout, status_5xx: a 502, 503 or 504).",
            ["model", "replica", "kind"], registry=r))
        self.replica_up = CachedLabels(Gauge(
            "llmgw_replica_up", "1 when the replica is routable, else 0.", ["model", "replica"], registry=r))
        self.decisions = CachedLabels(Counter(
            "llmgw_routing_decisions", "Routing decisions by model, tier and outcome.",
            ["model", "tier", "outcome"], registry=r))
        self.ttft = CachedLabels(Histogram(
            "llmgw_time_to_first_token_seconds", "Arrival of a request to its first token: the first SSE event "
            "carrying output of a stream (or a non-streamed body of one output token; other non-streamed answers "
            "are not observed here).", ["model", "replica"], buckets=LATENCY_BUCKETS, registry=r))
        self.inter_token = CachedLabels(Histogram(
            "llmgw_inter_token_latency_seconds", "Time before each output token after the first of a streamed "
            "response, one observation per token (as vllm:inter_token_latency_seconds); tokens that arrive "
            "together share the gap.", ["model", "replica"], buckets=TOKEN_LATENCY_BUCKETS, registry=r))
        self.e2e = CachedLabels(Histogram(
            "llmgw_e2e_request_latency_seconds", "Arrival of a request to the end of the response a replica "
            "served.", ["model", "replica"], buckets=LATENCY_BUCKETS, registry=r))
        self.prompt_tokens = CachedLabels(Counter(
            "llmgw_prompt_tokens", "Prompt tokens engines reported in usage.", ["model", "replica"], registry=r))
        self.cached_tokens = CachedLabels(Counter(
            "llmgw_cached_tokens", "Prompt tokens engines reported served from their prefix cache "
            "(usage.prompt_tokens_details.cached_tokens).", ["model", "replica"], registry=r))
        self.completion_tokens = CachedLabels(Counter(
            "llmgw_completion_tokens", "Output tokens engines reported in usage.", ["model", "replica"],
            registry=r))
        self.retries = CachedLabels(Counter(
            "llmgw_retries", "Requests sent again to another replica before the first byte.", ["model"],
            registry=r))
        self.client_disconnects = CachedLabels(Counter(
            "llmgw_client_disconnects", "Requests whose client went away before the response ended.", ["model"],
            registry=r))
        self.engine_priority_requests = CachedLabels(Counter(
            "llmgw_engine_priority_requests", "Requests sent to an engine in priority scheduling (a profile's or "
            "replica's scheduling_policy: priority) with a priority field set from their class, by model and "
            "class.", ["model", "class"], registry=r))
        self.waited_for_replica = CachedLabels(Counter(
            "llmgw_requests_waited_for_replica", "Requests of an autoscaled model that found no replica to take "
            "them after a failed attempt (its only engine gone or restarting) and waited for one up to their "
            "class's max_wait: routed, or none (answered as before).", ["model", "result"], registry=r))
        self.request_caused_failures = CachedLabels(Counter(
            "llmgw_upstream_request_failures", "Failed attempts the request itself may have caused, by reason; "
            "answered to the client, never retried elsewhere nor counted against the replica's health.",
            ["model", "replica", "reason"], registry=r))
        self.health_probes = CachedLabels(Counter(
            "llmgw_health_probes", "Active health probes by replica and result.", ["model", "replica", "result"],
            registry=r))
        self.rejected_bodies = CachedLabels(Counter(
            "llmgw_rejected_bodies", "Request bodies refused before routing, by reason "
            "(not_json, non_finite_number, too_deep, too_many_values, too_many_containers).", ["reason"], registry=r))
        self.loops_detected = Counter("llmgw_loops_detected", "Requests answered 508 Loop Detected: they came back "
                                      "to this gateway (their llmgw-hop header holds its instance id; a replica URL "
                                      "leads back to it) or passed through too many gateways.", registry=r)
        self.refused_requests = CachedLabels(Counter(
            "llmgw_http_refused_requests", "Requests the data plane's HTTP server answered itself with an error, "
            "by status (400 malformed, no or two Host headers; 408 too slow; 413, 431 too large; 501 transfer "
            "coding or upgrade; 505 HTTP version).", ["code"], registry=r))
        self.replaced_request_ids = Counter(
            "llmgw_replaced_request_ids", "Client x-request-id values not kept (more than 128 characters, or a "
            "space, control or non-ASCII byte): the request got an id of the gateway's own.", registry=r)
        # process_*, python_gc_*, python_info, and the process's descriptor shortages (llmgw_fd_exhaustion_total)
        for collector in (PROCESS_COLLECTOR, GC_COLLECTOR, PLATFORM_COLLECTOR, FD_EXHAUSTION):
            r.register(collector)
        self.trio_tasks = Gauge(
            "llmgw_trio_tasks", "Trio tasks alive in this process, counted when /metrics is read (a number that "
            "keeps growing under a steady load is a task leak).", registry=r)
        self.tls_handshake_failures = CachedLabels(Counter(
            "llmgw_tls_handshake_failures", "Client connections closed because their TLS handshake failed or "
            "timed out, by listener.", ["listener"], registry=r))
        self._replicas: dict[str, ReplicaMetrics] = {}
        self._models: dict[str, ModelMetrics] = {}

    def for_replica(self, replica) -> ReplicaMetrics:
        """The children of a replica's series (labelled with its ``name`` and ``model``), bound once."""
        bound = self._replicas.get(replica.name)
        if bound is None:
            bound = self._replicas[replica.name] = ReplicaMetrics(self, replica.name, replica.model)
        return bound

    def for_model(self, name: str) -> ModelMetrics:
        """The children of the per-model series, bound once (model names are configured, so bounded)."""
        bound = self._models.get(name)
        if bound is None:
            bound = self._models[name] = ModelMetrics(self, name)
        return bound

    def forget_replica(self, replica) -> None:
        """Drop the replica's gauges (its counters and histograms stay: they are totals)."""
        if self._replicas.pop(replica.name, None) is not None:
            for metric in (self.inflight, self.replica_up):
                try:
                    metric.remove(replica.model, replica.name)
                except KeyError:
                    pass


def trio_task_count() -> int:
    """Every task of the running Trio loop: the root task and all its descendants, through their nurseries."""
    count = 0
    pending = [trio.lowlevel.current_root_task()]
    while pending:
        task = pending.pop()
        if task is None:
            continue
        count += 1
        for nursery in task.child_nurseries:
            pending.extend(nursery.child_tasks)
    return count


async def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The exposition text of ``registry``, rendered in a worker thread (Trio's default, bounded limiter)."""
    body = await trio.to_thread.run_sync(generate_latest, registry)
    return body, CONTENT_TYPE_LATEST
