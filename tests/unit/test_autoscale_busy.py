"""Stepping ahead of saturation: the busy load's forecast (llmgw/autoscale/trend.py) and the scaler's utilisation
target, over synthetic loads with explicit times (a replica is ready ``READY`` seconds after its step)."""

from __future__ import annotations

import dataclasses
import random
from typing import Callable

import pytest

from llmgw.autoscale.model import AutoscaleSettings, DeploymentView, ModelSignals, ReplicaCounts, ScaleDecision
from llmgw.autoscale.scaler import TargetScaler, sane
from llmgw.autoscale.trend import BUCKETS, LoadTrend

READY = 60.0  # seconds from a step to its replicas serving (the cold start)
SETTINGS = AutoscaleSettings(min_replicas=1, max_replicas=6, scale_up_after=5, scale_down_after=300,
                             idle_to_zero=600, utilisation=0.7, lookahead=READY)
MANY_GPUS = {None: 1000}


def noisy(level: Callable[[float], float], seed: int = 1, spread: float = 0.35) -> Callable[[float], float]:
    """``level(t)`` with the noise of a few requests a second on two-seat engines (each reading up to ``spread``
    replicas off, uniformly)."""
    rng = random.Random(seed)
    return lambda t: max(0.0, level(t) + rng.uniform(-spread, spread))


@dataclasses.dataclass
class Fleet:
    """One deployment whose replicas become ready ``READY`` s after the step that asked for them."""

    desired: int
    ready: int
    started: list[tuple[float, int]] = dataclasses.field(default_factory=list)  # (ready at, count)

    def view(self, now: float, busy: float, queued: int = 0, settings: AutoscaleSettings = SETTINGS) -> DeploymentView:
        while self.started and self.started[0][0] <= now:
            self.ready += self.started.pop(0)[1]
        self.ready = min(self.ready, self.desired)
        starting = max(0, self.desired - self.ready)
        busy = min(busy, float(self.ready))  # a replica's seats are full at 1: the rest waits
        return DeploymentView("a", "model-a", settings, ReplicaCounts(ready=self.ready, starting=starting),
                              self.desired, 1, None,
                              ModelSignals("model-a", now, queued=queued, inflight=round(busy * 2), kv_usage=0.1,
                                           busy=busy, last_request_at=now))

    def apply(self, now: float, decisions: list[ScaleDecision]) -> None:
        for decision in decisions:
            if decision.desired > self.desired:
                self.started.append((now + READY, decision.desired - self.desired))
            self.desired = decision.desired


def run(load: Callable[[float], float], seconds: float, *, start: int = 1, queue_over: float | None = None,
        settings: AutoscaleSettings = SETTINGS) -> tuple[Fleet, list[ScaleDecision]]:
    """Decide every second over ``seconds`` of ``load`` (replicas' worth of busy seats); with ``queue_over``, a
    backlog of 5 per ready replica (over the target of 4) builds whenever the load is over their seats."""
    scaler, fleet, steps = TargetScaler({"a": settings}), Fleet(start, start), []
    for tick in range(int(seconds)):
        now = float(tick)
        demand = load(now)
        queued = 5 * fleet.ready if queue_over is not None and demand > fleet.ready else 0
        decisions = scaler.decide(now, [fleet.view(now, demand, queued, settings)], MANY_GPUS)
        fleet.apply(now, decisions)
        steps += [d for d in decisions if d.kind != "hold"]
    return fleet, steps


def reversals(steps: list[ScaleDecision]) -> int:
    kinds = [d.kind for d in steps if d.kind in ("up", "down")]
    return sum(1 for before, after in zip(kinds, kinds[1:]) if before != after)


# -- the forecast --------------------------------------------------------------------------------------------------


def test_a_ramp_is_forecast_a_lookahead_ahead_and_a_flat_noisy_load_is_not():
    ramp, flat = LoadTrend(), LoadTrend()
    wobbly = noisy(lambda t: 1.2)
    for tick in range(120):
        ramp.add(float(tick), 0.5 + 0.01 * tick, READY)  # 0.6 replicas a minute
        flat.add(float(tick), wobbly(tick), READY)
    rising = ramp.forecast(119.0, READY)
    assert rising is not None and rising.rise_per_s == pytest.approx(0.01, rel=0.05)
    assert rising.ahead == pytest.approx(0.5 + 0.01 * 179, abs=0.05)  # the load a cold start from now
    steady = flat.forecast(119.0, READY)
    assert steady is not None and steady.rise_per_s == 0 and not steady.falling
    assert steady.ahead == pytest.approx(1.2, abs=0.1)


def test_a_forecast_needs_a_few_buckets_and_keeps_a_bounded_window():
    trend = LoadTrend()
    trend.add(0.0, 1.0, READY)
    assert trend.forecast(0.0, READY) is None  # one bucket: no trend yet
    for tick in range(100_000):
        trend.add(float(tick), 1.0, READY)
    assert len(trend._buckets) <= BUCKETS + 1


def test_traffic_that_starts_is_no_ramp_until_the_window_is_full():
    """A fresh fleet's first requests: the busy load steps from nothing to 1.3 replicas; a line through the
    partial window would read that as a steep rise and step up for a load that is flat."""
    trend = LoadTrend()
    for tick in range(60):
        trend.add(float(tick), 0.0 if tick < 10 else 1.3, READY)
    early = trend.forecast(59.0, READY)
    assert early is not None and early.rise_per_s == 0 and early.ahead <= 1.3


def test_a_clock_that_goes_back_starts_the_window_over():
    trend = LoadTrend()
    for tick in range(100):
        trend.add(1000.0 + tick, 3.0, READY)
    trend.add(5.0, 0.5, READY)
    assert trend.forecast(5.0, READY) is None


def test_nan_and_negative_busy_readings_are_sanitised():
    view = Fleet(2, 2).view(0.0, 1.0)
    assert sane(dataclasses.replace(view, signals=dataclasses.replace(view.signals, busy=float("nan")))).signals.busy \
        is None
    assert sane(dataclasses.replace(view, signals=dataclasses.replace(view.signals, busy=-3.0))).signals.busy == 0
    assert sane(dataclasses.replace(view, signals=dataclasses.replace(view.signals, busy=50.0))).signals.busy == 2


# -- the decisions -------------------------------------------------------------------------------------------------


NIGHT = 150.0  # seconds of a flat load before the ramp: the window is full when the morning starts


def test_a_ramp_steps_up_a_cold_start_before_it_saturates_the_replica():
    """The diurnal morning: 0.3 replicas' worth rising 0.3 a minute (the bench's diurnal trace at its steepest).
    The second replica is asked for while the first is well under its seats and nothing is queued, and it is ready
    by the time the load fills one replica."""
    load = noisy(lambda t: 0.3 + 0.005 * max(0.0, t - NIGHT))
    fleet, steps = run(load, NIGHT + 300, queue_over=1.0)
    first_up = next(d for d in steps if d.kind == "up")
    saturated_at = NIGHT + (1.0 - 0.3) / 0.005  # 140 s into the ramp
    assert first_up.at + READY <= saturated_at + 5, first_up.reason  # serving about when one replica fills
    assert "busy" in first_up.reason and "rising" in first_up.reason and "queued" not in first_up.reason
    assert first_up.desired == 2


def test_without_a_busy_reading_the_same_ramp_waits_for_the_backlog():
    """The behaviour before (an engine whose seats are not learnt): the step comes only once a queue shows."""
    scaler, fleet = TargetScaler({"a": SETTINGS}), Fleet(1, 1)
    first_up = None
    for tick in range(300):
        demand = 0.3 + 0.005 * tick
        view = fleet.view(float(tick), demand, 5 * fleet.ready if demand > fleet.ready else 0)
        view = dataclasses.replace(view, signals=dataclasses.replace(view.signals, busy=None))
        decisions = scaler.decide(float(tick), [view], MANY_GPUS)
        fleet.apply(float(tick), decisions)
        first_up = first_up or next((d for d in decisions if d.kind == "up"), None)
    assert first_up is not None and first_up.at >= 140 and "queued" in first_up.reason


@pytest.mark.parametrize("level,replicas", [(0.5, 1), (1.2, 2), (1.9, 3), (2.5, 4)])
def test_a_constant_noisy_load_never_flaps(level, replicas):
    """An hour of a constant load, noisy as a few requests a second are: at most the one step to what it needs
    (from one replica), and no step back."""
    fleet, steps = run(noisy(lambda t: level, seed=int(level * 10)), 3600, start=replicas)
    assert reversals(steps) == 0, [d.reason for d in steps]
    assert len(steps) <= 1, [d.reason for d in steps]
    assert fleet.desired <= replicas + 1


def test_a_spike_that_ends_does_not_cascade_and_steps_back_down_one_at_a_time():
    """Five replicas' worth for 30 s over 0.4: the queue steps once to what it proves (no step per
    interval while they start), and once the spike is over the fleet returns one replica at a time."""
    def load(t: float) -> float:
        return 5.0 if 100 <= t < 130 else 0.4

    fleet, steps = run(noisy(load, seed=3, spread=0.1), 2400, start=1, queue_over=1.0)
    ups = [d for d in steps if d.kind == "up"]
    assert len(ups) == 1 and ups[0].desired <= 3, [d.reason for d in steps]  # never 2 -> 4 -> 8
    downs = [d for d in steps if d.kind == "down"]
    assert downs and all(d.current - d.desired == 1 for d in downs)
    assert fleet.desired == 1


def test_the_evening_fall_steps_down_after_a_lookahead_not_scale_down_after():
    """A load falling 0.6 replicas a minute from 3.5: each step down follows within about a minute and a half of
    one replica fewer becoming enough (not the 5 minutes of a constant load)."""
    def load(t: float) -> float:
        return max(0.3, 3.5 - 0.01 * t)

    fleet, steps = run(noisy(load, seed=5), 400, start=6)
    downs = [d for d in steps if d.kind == "down"]
    assert downs and all("falling" in d.reason for d in downs), [d.reason for d in steps]
    assert downs[0].at < 300  # scale_down_after would have held every replica until 300 s
    assert fleet.desired <= 4
    assert not [d for d in steps if d.kind == "up"]


def test_the_status_says_the_forecast():
    scaler = TargetScaler({"a": SETTINGS})
    fleet = Fleet(1, 1)
    for tick in range(30):
        scaler.decide(float(tick), [fleet.view(float(tick), 0.5)], MANY_GPUS)
    busy = scaler.status(29.0)["deployments"]["a"]["busy"]
    assert busy["level"] == pytest.approx(0.5) and busy["rise_per_s"] == 0 and busy["falling"] is False
