"""What the simulators' own ``/metrics`` say of one run of ``llmgw bench overload``: the model apart from the machine.

A client's TTFT and ITL include whatever the host added (a machine shared with other work delays the engines'
loops); the simulators export each step's modelled length (``llmgw_sim_step_seconds``, what the modelled GPU takes,
x the time scale), how much later than that each step ended (``llmgw_sim_step_overrun_seconds``: the host), their
inter-token latency on the modelled clock (``vllm:inter_token_latency_seconds``) and the prefill chunks their
``--long-prefill-token-threshold`` cut. :func:`read_engines` sums every engine's histograms (bucket by bucket) and
counters; :func:`engine_stats` turns two readings, before and after a run, into that run's quantiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import trio

from ..testing.metrics import series_sum
from .cluster_events import histogram, histogram_quantile

STEP, OVERRUN, ITL = "llmgw_sim_step_seconds", "llmgw_sim_step_overrun_seconds", "vllm:inter_token_latency_seconds"
HISTOGRAMS = (STEP, OVERRUN, ITL)
CAPPED = "llmgw_sim_prefill_chunks_capped_total"


@dataclass
class EngineReading:
    """Every engine's histograms summed (name -> upper bound -> cumulative count) and its capped chunks."""

    buckets: dict[str, dict[float, float]] = field(default_factory=dict)
    capped_chunks: float = 0.0


async def read_engines(http: httpx.AsyncClient, urls: Sequence[str], timeout: float = 5.0) -> EngineReading | None:
    """The engines' readings summed; None when one did not answer in ``timeout`` (a partial sum would lie)."""
    reading = EngineReading({name: {} for name in HISTOGRAMS})
    with trio.move_on_after(timeout):
        for url in urls:
            try:
                response = await http.get(url + "/metrics")
            except httpx.HTTPError:
                return None
            if response.status_code != 200:
                return None
            text = response.text
            for name in HISTOGRAMS:
                summed = reading.buckets[name]
                for bound, count in histogram(text, name).items():
                    summed[bound] = summed.get(bound, 0.0) + count
            reading.capped_chunks += series_sum(text, CAPPED)
        return reading
    return None


def _quantile_ms(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    found = histogram_quantile(q, {bound: count - before.get(bound, 0.0) for bound, count in after.items()})
    return None if found is None else found * 1000


def engine_stats(before: EngineReading | None, after: EngineReading | None) -> dict | None:
    """One run's: its steps, their modelled length p50/p99, the host's overrun p50/p99, the modelled ITL p99 (ms,
    interpolated within the histograms' buckets as Prometheus does) and the chunks capped; None without both
    readings."""
    if before is None or after is None:
        return None

    def delta(name: str) -> tuple[dict[float, float], dict[float, float]]:
        return before.buckets.get(name, {}), after.buckets.get(name, {})

    steps = after.buckets[STEP].get(float("inf"), 0.0) - before.buckets[STEP].get(float("inf"), 0.0)
    return {"steps": steps,
            "step_p50_ms": _quantile_ms(*delta(STEP), 0.5), "step_p99_ms": _quantile_ms(*delta(STEP), 0.99),
            "overrun_p50_ms": _quantile_ms(*delta(OVERRUN), 0.5),
            "overrun_p99_ms": _quantile_ms(*delta(OVERRUN), 0.99),
            "itl_p99_ms": _quantile_ms(*delta(ITL), 0.99),
            "capped_chunks": after.capped_chunks - before.capped_chunks}
