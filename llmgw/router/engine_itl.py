"""Inter-token latency as an engine reports it on ``/metrics``: the decode charge's slopes from the engine's own steps.

The decode charge (:mod:`llmgw.router.decode_cost`) needs how a replica's
inter-token latency grows with its running batch and their context. Learnt
from the token gaps the gateway relays, it includes whatever slows the
stream between the engine and the gateway: on simulators sharing a loaded CPU
that was each simulator process's own Python per stream (~0.3 ms a sequence,
where the modelled H100 adds ~0.02 ms). vLLM measures each token's gap
itself, per engine, in a histogram (``vllm:inter_token_latency_seconds``; vLLM
before 0.11 named it ``vllm:time_per_output_token_seconds``, 0.11 exports
both: the first name found is read, never both). Between two scrapes of the
load scraper (:mod:`llmgw.router.load_scraper`), the rule (also in
``docs/routing.md``)::

    ITL     = Δ _sum / Δ _count              the window's mean gap between a request's tokens
    B       = the mean of vllm:num_requests_running at the window's two scrapes
    C       = the mean of kv_cache_usage_perc x num_gpu_blocks x block_size at the two (0 when never exported)
    observe ITL against (B, C) in the decode model's fit (ITL = base + per_sequence x B + per_context_token x C)

A window counts when its gaps are ``MIN_WINDOW_TOKENS`` or more, its mean is
within ``(0, MAX_ITL]``, a request ran at one of its ends at least, and both
ends told the KV usage or neither did. A counter that
went backwards (a restarted engine) or a value that is not a finite number
>= 0 starts the windows again from that scrape; nothing counts from an
engine's history before the first scrape (its batch then is unknown). The
fit is the decode model's ridge regression (:class:`~llmgw.router.decode_cost.ItlFit`,
the fleet's terms left at 0: an engine's own step times have no host in them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..engines.probe import EngineLoad, parse_gauge_sum
from .decode_cost import MAX_ITL, ItlFit

ITL_NAMES = ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")  # new, then before 0.11
MIN_WINDOW_TOKENS = 8  # a window's gaps: fewer say little of the mean
MAX_RUNNING = 1 << 20  # bounds of a sane engine's gauges
MAX_CONTEXT_TOKENS = float(1 << 40)
DECAY = 0.99  # per counted window: about the last 100 count (25 s at a 250 ms scrape interval)


@dataclass(frozen=True, slots=True)
class ItlCounters:
    """An engine's cumulative inter-token latency histogram at one scrape (summed over its engine cores), with the
    running batch and context tokens it reported in the same text."""

    seconds: float
    tokens: float
    running: float
    context_tokens: float | None  # None: the engine told no KV usage and capacity in this scrape


def read_counters(text: str, load: EngineLoad | None) -> ItlCounters | None:
    """The ITL histogram's sum and count from ``/metrics`` text (the first of ``ITL_NAMES`` it exports) and the
    batch and context ``load`` read from the same text; None when it exports no such histogram, no running
    gauge, or a value that is not a finite number >= 0 (or beyond the bounds)."""
    if load is None:
        return None
    for name in ITL_NAMES:
        seconds = parse_gauge_sum(text, (name + "_sum",))
        tokens = parse_gauge_sum(text, (name + "_count",))
        if seconds is not None and tokens is not None:
            break
    else:
        return None
    context = None
    if load.kv_usage is not None and load.num_blocks is not None and load.block_size is not None:
        context = load.kv_usage * load.num_blocks * load.block_size
    values = (seconds, tokens, load.running, 0.0 if context is None else context)
    if not all(math.isfinite(v) and v >= 0 for v in values):
        return None
    if load.running > MAX_RUNNING or values[3] > MAX_CONTEXT_TOKENS:
        return None
    return ItlCounters(seconds, tokens, load.running, context)


class EngineItl:
    """One replica's ITL fit from its engine's successive :class:`ItlCounters`."""

    __slots__ = ("last", "data", "windows", "resets", "last_itl")

    def __init__(self) -> None:
        self.last: ItlCounters | None = None
        self.data = ItlFit()
        self.windows = 0  # windows counted into the fit
        self.resets = 0  # counters seen going backwards (an engine restarted)
        self.last_itl: float | None = None  # the last counted window's mean ITL (s)

    def update(self, counters: ItlCounters | None) -> None:
        """Count the window since the last scrape; None (the scrape told no ITL) starts the windows again."""
        last, self.last = self.last, counters
        if last is None or counters is None:
            return
        tokens, seconds = counters.tokens - last.tokens, counters.seconds - last.seconds
        if tokens < 0 or seconds < 0:
            self.resets += 1
            return
        if tokens < MIN_WINDOW_TOKENS or max(last.running, counters.running) < 1:
            return
        if (last.context_tokens is None) != (counters.context_tokens is None):
            return  # the usage gauge came or went: the window's context is unknown
        itl = seconds / tokens
        if not 0 < itl <= MAX_ITL:
            return
        batch = (last.running + counters.running) / 2
        context = ((last.context_tokens or 0.0) + (counters.context_tokens or 0.0)) / 2
        self.data.add((1.0, context, batch, 0.0, 0.0), itl, DECAY)
        self.windows += 1
        self.last_itl = itl
