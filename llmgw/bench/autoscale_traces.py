"""The demand traces of ``llmgw bench autoscale``, and the open-loop arrival times they give.

A trace says, for each of its models at each instant of *fleet time* (the seconds a real fleet would live
through), how much demand there is in **replicas' worth**: 1.0 is what one replica serves at the measured
per-replica capacity. The bench compresses fleet time by a stated factor (``--time-factor``: the engines' startup,
the scaler's windows and the trace all run that many times faster; a request itself runs at the engine's speed), so
that a 20-minute diurnal trace fits in two.

- ``step``: one model at 1.8 replicas' worth, doubled to 3.6 at a third of the trace (the 1x -> 2x step); its
  ``min`` is the 2 replicas the base needs.
- ``diurnal``: one model following a compressed day, from 0.5 up to 3.5 replicas' worth and back (a cosine).
- ``swap``: two models, one busy (3.4) and one quiet (0.6); halfway through they swap.
- ``idle``: one model with ``min`` 0, not called for the first half, then called at 1.2 replicas' worth.

:func:`arrival_times` draws a Poisson process whose rate follows a trace (thinning: candidates at the peak rate,
each kept with probability rate/peak), in wall seconds.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MODEL_A, MODEL_B = "llama-a", "llama-b"
Shape = Callable[[str, float], float]  # (model, fleet seconds) -> replicas' worth of demand


@dataclass(frozen=True)
class Trace:
    name: str
    description: str
    seconds: float  # its length in fleet seconds
    models: tuple[str, ...]
    shape: Shape
    peak: float  # the largest value ``shape`` takes (thinning's bound)
    min_replicas: int = 1  # every model's bounds in the autoscaled arm; the fixed arms run one or the other
    max_replicas: int = 4
    step_at: float | None = None  # fleet seconds of the step whose extra replica the report times
    called_at: float | None = None  # fleet seconds at which an idle model is first called

    def demand(self, model: str, fleet_seconds: float) -> float:
        return self.shape(model, fleet_seconds)


def step_trace(seconds: float = 600.0, base: float = 1.8) -> Trace:
    """The fleet starts (and stays at least) at what the base demand needs, so that the time to serving measures
    the step itself, not a fleet still growing toward the base when the step comes."""
    at = seconds / 3
    return Trace("step", f"{base:g} replicas' worth, {2 * base:g} from {at:g} s", seconds, (MODEL_A,),
                 lambda _model, t: base if t < at else 2 * base, 2 * base, min_replicas=math.ceil(base), step_at=at)


def diurnal_trace(seconds: float = 1200.0, low: float = 0.5, high: float = 3.5) -> Trace:
    def shape(_model: str, t: float) -> float:
        return low + (high - low) * (1 - math.cos(2 * math.pi * t / seconds)) / 2

    return Trace("diurnal", f"a day in {seconds:g} s: {low:g} at night, {high:g} at noon", seconds, (MODEL_A,),
                 shape, high)


def swap_trace(seconds: float = 900.0, busy: float = 3.4, quiet: float = 0.6) -> Trace:
    half = seconds / 2

    def shape(model: str, t: float) -> float:
        first = model == MODEL_A
        return busy if (t < half) == first else quiet

    return Trace("swap", f"{MODEL_A} {busy:g} and {MODEL_B} {quiet:g} replicas' worth, swapped at {half:g} s",
                 seconds, (MODEL_A, MODEL_B), shape, busy, step_at=half)


def idle_trace(seconds: float = 600.0, load: float = 1.2) -> Trace:
    half = seconds / 2
    return Trace("idle", f"no request until {half:g} s, then {load:g} replicas' worth (min 0)", seconds, (MODEL_A,),
                 lambda _model, t: 0.0 if t < half else load, load, min_replicas=0, called_at=half)


TRACES: dict[str, Callable[[], Trace]] = {"step": step_trace, "diurnal": diurnal_trace, "swap": swap_trace,
                                          "idle": idle_trace}


def shortened(trace: Trace, share: float) -> Trace:
    """``trace`` over ``share`` of its length (``--quick``): every instant of it at ``t / share``."""
    return Trace(trace.name, trace.description + f" (over {share:.0%} of its length)", trace.seconds * share,
                 trace.models, lambda model, t: trace.shape(model, t / share), trace.peak,
                 trace.min_replicas, trace.max_replicas,
                 None if trace.step_at is None else trace.step_at * share,
                 None if trace.called_at is None else trace.called_at * share)


def arrival_times(trace: Trace, model: str, replica_rps: float, factor: float, rng: random.Random) -> list[float]:
    """The wall seconds (from the trace's start) at which ``model``'s requests arrive: a Poisson process of rate
    ``demand * replica_rps`` per wall second, fleet time running ``factor`` times faster than the wall's."""
    peak = trace.peak * replica_rps
    wall = trace.seconds / factor
    times: list[float] = []
    if peak <= 0:
        return times
    at = rng.expovariate(peak)
    while at < wall:
        if rng.random() * peak < trace.demand(model, at * factor) * replica_rps:
            times.append(at)
        at += rng.expovariate(peak)
    return times


def instants(seconds: float, step: float) -> Sequence[float]:
    """``0, step, 2 step...`` below ``seconds``."""
    return [i * step for i in range(max(0, math.ceil(seconds / step - 1e-9)))]
