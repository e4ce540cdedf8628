"""Per-replica summaries of this process's own series for ``GET /admin/stats``: requests, TTFT, latency and the
prefix-cache hit rate, so that the status page (``/ui``) need not parse Prometheus text.

The figures are those ``/metrics`` exports (:mod:`llmgw.metrics`), totals since this process started: the hit
rate is ``llmgw_cached_tokens / llmgw_prompt_tokens``, the quantiles are estimated from the histograms' buckets
as Prometheus's ``histogram_quantile`` does (linear within a bucket).
"""

from __future__ import annotations

from typing import Any, Iterable

from ..metrics import Metrics

QUANTILES = (0.5, 0.9)
Key = tuple[str, str]  # (model, replica)


def replica_stats(metrics: Metrics) -> list[dict[str, Any]]:
    """One entry per replica this process has served, sorted by model and replica."""
    ttft, latency = _histograms(metrics.ttft), _histograms(metrics.e2e)
    prompt, cached = _totals(metrics.prompt_tokens), _totals(metrics.cached_tokens)
    entries = []
    for model, replica in sorted(set(ttft) | set(latency) | set(prompt)):
        key = (model, replica)
        prompt_tokens, cached_tokens = prompt.get(key, 0), cached.get(key, 0)
        entries.append({
            "model": model, "replica": replica, "requests": int(latency[key].count) if key in latency else 0,
            "ttft": _summary(ttft.get(key)), "latency": _summary(latency.get(key)),
            "prompt_tokens": int(prompt_tokens), "cached_tokens": int(cached_tokens),
            "hit_rate": round(cached_tokens / prompt_tokens, 4) if prompt_tokens else None})
    return entries


class Histogram:
    """One histogram series: cumulative ``(upper bound, count)`` buckets, ending with ``+Inf``."""

    __slots__ = ("buckets", "count", "sum")

    def __init__(self) -> None:
        self.buckets: list[tuple[float, float]] = []
        self.count = 0.0
        self.sum = 0.0

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile, interpolated linearly in its bucket (the highest finite bound when it falls in
        ``+Inf``); None without observations."""
        if not self.count:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cumulative in self.buckets:
            if cumulative >= rank:
                if bound == float("inf"):
                    return lower_bound
                inside = cumulative - lower_count
                share = (rank - lower_count) / inside if inside else 1.0
                return lower_bound + (bound - lower_bound) * share
            lower_bound, lower_count = bound, cumulative
        return lower_bound


def _summary(histogram: Histogram | None) -> dict[str, float | None] | None:
    if histogram is None or not histogram.count:
        return None
    summary: dict[str, float | None] = {"count": int(histogram.count),
                                        "mean_ms": round(histogram.sum / histogram.count * 1000, 1)}
    for q in QUANTILES:
        value = histogram.quantile(q)
        summary[f"p{round(q * 100)}_ms"] = None if value is None else round(value * 1000, 1)
    return summary


def _samples(metric) -> Iterable[tuple[str, dict[str, str], float]]:
    for family in metric.collect():
        for sample in family.samples:
            yield sample.name, sample.labels, sample.value


def _histograms(metric) -> dict[Key, Histogram]:
    found: dict[Key, Histogram] = {}
    for name, labels, value in _samples(metric):
        histogram = found.setdefault((labels["model"], labels["replica"]), Histogram())
        if name.endswith("_bucket"):
            histogram.buckets.append((float(labels["le"]), value))
        elif name.endswith("_count"):
            histogram.count = value
        elif name.endswith("_sum"):
            histogram.sum = value
    return found


def _totals(metric) -> dict[Key, float]:
    return {(labels["model"], labels["replica"]): value
            for name, labels, value in _samples(metric) if name.endswith("_total")}
