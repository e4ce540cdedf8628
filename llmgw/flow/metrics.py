"""The gateway queue's metrics (``llmgw_flow_*``: labels model, class and reason at most, never a flow;
docs/metrics.md, "Flow control")."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..cached_labels import CachedLabels

WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
# Seconds waited less seconds predicted on arrival: early (below 0) or late
PREDICTION_ERROR_BUCKETS = (-2.0, -1.0, -0.5, -0.25, -0.1, -0.05, 0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
RETRY_AFTER_BUCKETS = (1, 2, 5, 10, 20, 30, 60, 120, 300)


class FlowMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry
        self.queued = CachedLabels(Gauge(
            "llmgw_flow_queued", "Requests waiting at this gateway's queue, by model and priority class.",
            ["model", "class"], registry=r))
        self.queued_tokens = CachedLabels(Gauge(
            "llmgw_flow_queued_tokens", "Estimated tokens (prompt + output) of the requests waiting, by model "
            "and priority class.", ["model", "class"], registry=r))
        self.wait = CachedLabels(Histogram(
            "llmgw_flow_wait_seconds", "Time admitted requests waited in the queue (0 for those dispatched at "
            "once), by model and priority class.", ["model", "class"], buckets=WAIT_BUCKETS, registry=r))
        self.admitted = CachedLabels(Counter(
            "llmgw_flow_admitted", "Requests the queue admitted (at once or after waiting), by model and priority "
            "class.", ["model", "class"], registry=r))
        self.shed = CachedLabels(Counter(
            "llmgw_flow_shed", "Requests the queue answered 429, by model, priority class and reason: expired "
            "(its deadline passed waiting), overflow (the queue was full), unservable (the queue ahead would not "
            "drain before its deadline).", ["model", "class", "reason"], registry=r))
        self.retry_after = CachedLabels(Histogram(
            "llmgw_flow_retry_after_seconds", "Retry-After given with the queue's 429s, by model and priority "
            "class.", ["model", "class"], buckets=RETRY_AFTER_BUCKETS, registry=r))
        self.early_shed_verdicts = CachedLabels(Counter(
            "llmgw_flow_early_shed_verdicts", "Requests shed early (reason unservable), judged afterwards, by "
            "model, priority class and verdict: idle_in_time (its class's queue emptied before its deadline: a "
            "wrong shed), turn_in_time (its turn came in time, in a busy queue: served in another's place), "
            "would_expire (a right shed), unknown (too many awaiting a verdict).",
            ["model", "class", "verdict"], registry=r))
        self.prediction_error = CachedLabels(Histogram(
            "llmgw_flow_wait_prediction_error_seconds", "Of requests admitted to wait on a predicted wait, the "
            "seconds they waited less the seconds predicted on arrival, by model, priority class and outcome: "
            "admitted (dispatched), unservable (shed while waiting), expired (its deadline passed); for the last "
            "two the wait so far, a lower bound.", ["model", "class", "outcome"],
            buckets=PREDICTION_ERROR_BUCKETS, registry=r))
        self.prediction_factor = CachedLabels(Gauge(
            "llmgw_flow_wait_prediction_factor", "What a class's waits came to over the waits predicted on their "
            "arrival (the 90th percentile of its latest 128 waiters): an arrival is shed at once when its predicted "
            "wait times this (within 1.11 and 4) passes its deadline; 1.11 while none of them missed its deadline; "
            "absent until learnt.", ["model", "class"],
            registry=r))
        self.drain_rate = CachedLabels(Gauge(
            "llmgw_flow_drain_tokens_per_second", "Estimated tokens per second a model's queue is dispatched at "
            "while requests wait (an EWMA over half-second windows of backlog); absent until measured.",
            ["model"], registry=r))
