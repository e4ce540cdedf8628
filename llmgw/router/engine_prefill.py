"""Prefill throughput as an engine reports it on ``/metrics``: where the cost model's slope starts from.

The cost model (:mod:`llmgw.router.cost`) learns a replica's prefill
throughput from the times to first token the gateway observes. A
cache-friendly workload shows it few requests with many new tokens, so its
slope stays near the prior (``cost_prefill_tokens_per_s``) while a cold
prefill of thousands of tokens is estimated with it: 1.4-2.8x off on the
simulator's H100 and constant profiles (``docs/benchmarks/routing-workloads.md``). vLLM counts,
per engine, what gives the rate (the rule, also in ``docs/routing.md``)::

    new tokens   = Δ vllm:prompt_tokens_total - Δ vllm:prefix_cache_hits_total
    prefill time = Δ vllm:request_prefill_time_seconds_sum     (each request: its first step to its first token)
    prefills     = Δ vllm:request_prefill_time_seconds_count
    rate         = Σ new tokens / Σ prefill time over the scrape intervals whose prefills computed
                   MIN_NEW_TOKENS_PER_PREFILL new tokens or more each on average

between two scrapes of the load scraper (:mod:`llmgw.router.load_scraper`).
A cache hit's prefill is one engine step, whose time is mostly the step's
fixed cost, not its few tokens: intervals of hits say nothing of the rate and
are left out. Prefills that overlap (chunked prefill puts several in one
step) each count the steps they share, so their rate reads low: an interval
whose prefill seconds exceed its wall-clock seconds (per engine core) had
overlapping prefills for certain and is left out too (overlaps within less
are not seen: under concurrent cold prefills the rate still reads low).
The first scrape counts from zero, so an engine that served before this
gateway started (or before it was adopted) tells its rate at once;
counters that went backwards (a restarted engine) count from zero again.
Intervals fade by ``DECAY`` each. The rate is the prior the replica's fit
starts from, worth ``ENGINE_RATE_WEIGHT`` observations, which the
gateway's own observations (which model the queue) then move; off by default
(``cost_engine_prefill``), since the overlap bias measured on the routing
benchmark's concurrent cold prefills priced them up to 3x too slow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..engines.probe import parse_gauge_sum

PROMPT_TOKENS = ("vllm:prompt_tokens_total",)
CACHED_TOKENS = ("vllm:prefix_cache_hits_total",)
PREFILL_SECONDS = ("vllm:request_prefill_time_seconds_sum",)
PREFILLS = ("vllm:request_prefill_time_seconds_count",)
MIN_NEW_TOKENS_PER_PREFILL = 256.0  # an interval's prefills must average this many new tokens to tell the rate
DECAY = 0.9  # per counted interval: about the last 10 count
MIN_RATE, MAX_RATE = 50.0, 1e8  # prompt tokens / s (the cost model's bounds)


@dataclass(frozen=True, slots=True)
class PrefillCounters:
    """An engine's cumulative prefill counts at one scrape (summed over its engine cores)."""

    prompt_tokens: float
    cached_tokens: float
    seconds: float
    prefills: float
    at: float = 0.0  # the scrape's clock (seconds)
    cores: int = 1  # the engine cores whose counters were summed


def read_counters(text: str, at: float = 0.0) -> PrefillCounters | None:
    """vLLM's prefill counts from ``/metrics`` text scraped at ``at``; None when the engine exports no prefill-time
    histogram or a count that is not a finite number >= 0."""
    values = [parse_gauge_sum(text, names) for names in (PROMPT_TOKENS, CACHED_TOKENS, PREFILL_SECONDS, PREFILLS)]
    if values[2] is None or values[3] is None or values[0] is None:
        return None
    counts = [0.0 if v is None else v for v in values]
    if not all(math.isfinite(v) and v >= 0 for v in counts):
        return None
    cores = sum(text.count("\n" + name + "{") + text.startswith(name + "{") for name in PREFILLS) or 1
    return PrefillCounters(counts[0], counts[1], counts[2], counts[3], at, cores)


class EnginePrefillRate:
    """One replica's engine-reported prefill rate, from its successive :class:`PrefillCounters`."""

    __slots__ = ("last", "tokens", "seconds", "intervals")

    def __init__(self) -> None:
        self.last: PrefillCounters | None = None
        self.tokens = 0.0  # decayed sums over the counted intervals
        self.seconds = 0.0
        self.intervals = 0

    def update(self, counters: PrefillCounters) -> None:
        """Count the interval since the last scrape (since zero at the first, or after a restart)."""
        last = self.last
        self.last = counters
        wall = math.inf  # the engine's history before the first scrape: how long it took is unknown
        if last is not None and all(now >= before for now, before in zip(
                (counters.prompt_tokens, counters.cached_tokens, counters.seconds, counters.prefills),
                (last.prompt_tokens, last.cached_tokens, last.seconds, last.prefills))):
            wall = (counters.at - last.at) * counters.cores
        else:
            last = PrefillCounters(0.0, 0.0, 0.0, 0.0)
        prefills = counters.prefills - last.prefills
        seconds = counters.seconds - last.seconds
        new_tokens = (counters.prompt_tokens - last.prompt_tokens) - (counters.cached_tokens - last.cached_tokens)
        if prefills <= 0 or seconds <= 0 or new_tokens < MIN_NEW_TOKENS_PER_PREFILL * prefills or seconds > wall:
            return
        self.tokens = self.tokens * DECAY + new_tokens
        self.seconds = self.seconds * DECAY + seconds
        self.intervals += 1

    @property
    def tokens_per_s(self) -> float | None:
        """New prompt tokens per second of prefill, None until an interval told it."""
        if not self.intervals or self.seconds <= 0:
            return None
        return min(max(self.tokens / self.seconds, MIN_RATE), MAX_RATE)
