"""The limiter's metrics (``llmgw_tenant_*``: labels team and limit at most, never a key; docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ..cached_labels import CachedLabels

LEASE_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LimiterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = registry
        self.admitted = CachedLabels(Counter(
            "llmgw_tenant_admitted", "Requests of limited keys the limiter admitted, by team (none: a key without "
            "a team).", ["team"], registry=r))
        self.limited = CachedLabels(Counter(
            "llmgw_tenant_limited", "Requests refused (429) by a limit, by team and the limit that refused: "
            "requests, tokens, concurrency (rate_limit_exceeded), budget_tokens, budget_usd (insufficient_quota "
            "when spent, rate_limit_exceeded when held by requests in flight or other processes' shares).",
            ["team", "limit"], registry=r))
        self.lease_calls = CachedLabels(Counter(
            "llmgw_tenant_lease_calls", "Calls to Redis for shares of the limits (leases), by kind (take, give, "
            "renew) and outcome (ok, failed).", ["kind", "outcome"], registry=r))
        self.lease_seconds = Histogram(
            "llmgw_tenant_lease_call_seconds", "Time of one lease call to Redis (a batch of subjects).",
            buckets=LEASE_BUCKETS, registry=r)
        self.lease_waits = Counter(
            "llmgw_tenant_lease_waits", "Requests that waited for a lease call because the process's share could "
            "not cover them (a key's first request, a burst); the rest were admitted without Redis.", registry=r)
        self.budget_waits = Counter(
            "llmgw_tenant_budget_waits", "Requests a budget could not cover after a lease call while its use so "
            "far could: they waited (up to lease_idle_seconds) for what other processes' leases and requests in "
            "flight held, instead of being refused as spent.", registry=r)
        self.lapsed_holders = CachedLabels(Counter(
            "llmgw_tenant_lapsed_holders", "Processes whose concurrency slots or budget share Redis dropped because "
            "they stopped renewing them (killed, or cut off from Redis for the holder TTL): what they held went "
            "back. Counted by the process whose call dropped them, by limit.", ["limit"], registry=r))
        self.degraded = Gauge(
            "llmgw_tenant_limiter_degraded", "1 while Redis is away and the limiter runs on its fallback (rate "
            "limits divided by the live processes, budgets on the leases in hand), else 0.", registry=r)
