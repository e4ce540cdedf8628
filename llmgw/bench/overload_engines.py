"""What the simulators' and the gateways' own ``/metrics`` say of one run of ``llmgw bench overload``: the model
apart from the machine, and where an interactive first token waited.

A client's TTFT and ITL include whatever the host added (a machine shared with other work delays the engines'
loops); the simulators export each step's modelled length (``llmgw_sim_step_seconds``, what the modelled GPU takes,
x the time scale), how much later than that each step ended (``llmgw_sim_step_overrun_seconds``: the host), their
inter-token latency on the modelled clock (``vllm:inter_token_latency_seconds``) and the prefill chunks their
``--long-prefill-token-threshold`` cut. :func:`read_engines` sums every engine's histograms (bucket by bucket) and
counters, and the llmgw gateways' ``llmgw_flow_wait_seconds{class="interactive"}`` (the interactive requests' wait
in the gateways' queues: what of their TTFT is the gateway's, the rest being the engines' queues and steps);
:func:`engine_stats` turns two readings, before and after a run, into that run's quantiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import httpx
import trio

from ..testing.metrics import samples, series_sum
from .cluster_events import histogram_quantile

STEP, OVERRUN, ITL = "llmgw_sim_step_seconds", "llmgw_sim_step_overrun_seconds", "vllm:inter_token_latency_seconds"
HISTOGRAMS = (STEP, OVERRUN, ITL)
CAPPED = "llmgw_sim_prefill_chunks_capped_total"
GATEWAY_WAIT, WAIT_CLASS = "llmgw_flow_wait_seconds", 'class="interactive"'


def buckets(text: str, name: str, labels: str = "") -> dict[float, float]:
    """Histogram ``name``'s cumulative bucket counts in Prometheus ``text`` (upper bound -> count), summed over its
    series whose labels hold ``labels``."""
    out: dict[float, float] = {}
    for key, value in samples(text).items():
        if key.startswith(name + "_bucket{") and labels in key:
            bound = key.split('le="', 1)[1].split('"', 1)[0]
            le = float("inf") if bound == "+Inf" else float(bound)
            out[le] = out.get(le, 0.0) + value
    return out


@dataclass
class EngineReading:
    """Every engine's histograms summed (name -> upper bound -> cumulative count) and its capped chunks."""

    buckets: dict[str, dict[float, float]] = field(default_factory=dict)
    capped_chunks: float = 0.0


async def read_engines(http: httpx.AsyncClient, urls: Sequence[str], gateways: Sequence[str] = (),
                       timeout: float = 5.0) -> EngineReading | None:
    """The engines' readings summed, with the ``gateways``' interactive queue wait; None when one did not answer in
    ``timeout`` (a partial sum would lie)."""
    reading = EngineReading({name: {} for name in (*HISTOGRAMS, GATEWAY_WAIT)})
    with trio.move_on_after(timeout):
        for url in [*urls, *gateways]:
            try:
                response = await http.get(url + "/metrics")
            except httpx.HTTPError:
                return None
            if response.status_code != 200:
                return None
            text = response.text
            for name in (*HISTOGRAMS, GATEWAY_WAIT):
                summed = reading.buckets[name]
                for bound, count in buckets(text, name, WAIT_CLASS if name == GATEWAY_WAIT else "").items():
                    summed[bound] = summed.get(bound, 0.0) + count
            reading.capped_chunks += series_sum(text, CAPPED)
        return reading
    return None


def _quantile_ms(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    found = histogram_quantile(q, {bound: count - before.get(bound, 0.0) for bound, count in after.items()})
    return None if found is None else found * 1000


def engine_stats(before: EngineReading | None, after: EngineReading | None) -> dict | None:
    """One run's: its steps, their modelled length p50/p99, the host's overrun p50/p99, the modelled ITL p99, the
    interactive wait in the gateways' queues p50/p99 (ms, interpolated within the histograms' buckets as Prometheus
    does; None without a gateway queue) and the chunks capped; None without both readings."""
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
            "gateway_wait_p50_ms": _quantile_ms(*delta(GATEWAY_WAIT), 0.5),
            "gateway_wait_p99_ms": _quantile_ms(*delta(GATEWAY_WAIT), 0.99),
            "capped_chunks": after.capped_chunks - before.capped_chunks}
