"""The decision core of autoscaling: from each deployment's signals and replica counts, the replicas it should run.

Pure: :meth:`TargetScaler.decide` reads the views it is given and its own memory (when a need started, the last
step, the cross-model move in flight) and returns decisions; it does no I/O and never waits. The rules, per
deployment (docs/autoscaling.md says why each is there):

- **targets**: the replicas the load needs is the largest of ``ceil(queued / queued_per_replica)`` (a count of
  work waiting, so it proves how many; capped by :func:`backlog_cap` at the replicas that serve the arrivals at the
  ready replicas' measured drain rate plus one, and at one before any replica is ready: no cascade from zero),
  ``ceil(ready x kv / kv_usage)`` when the KV usage of the ready replicas is over its target, one more than
  provisioned while TTFT attainment is under its target, and ``ceil(busy ahead / utilisation)``: the ready
  replicas' busy seats forecast one ``lookahead`` ahead (:mod:`.trend`: the window's level and its proven rise),
  so that a ramp steps up a cold start before it saturates the replicas rather than after a backlog;
- **pending-aware**: replicas starting count as provisioned; while a step is in flight (a replica starting, or
  one decided and not yet placed), the signals measured on the ready replicas (KV, TTFT) cannot see it and do not
  step again; only the queue can prove that more is needed, and then the step goes straight to what it needs
  (capped at ``max_replicas``): no 2 -> 4 -> 8 cascade;
- **windows**: a need to grow must hold ``scale_up_after``, a need to shrink ``scale_down_after`` (counted from
  the last step too), and a step down is one replica;
- **hysteresis**: a step down only when every known signal would stay under :data:`DOWN_FRACTION` of its target
  with one replica fewer (the busy load under :data:`BUSY_DOWN_FRACTION` of ``utilisation``; without a KV or a
  busy reading, only when nothing is in flight); a fall the busy load's window proves waits ``lookahead`` rather
  than ``scale_down_after`` (the load a cold start ahead is known to be lower: the step down follows the evening
  as the step up follows the morning);
- **from zero**: a request queued for a model with no replica starts one at once; **to zero**: no request for
  ``idle_to_zero`` returns the deployment to ``min_replicas``;
- **across models**: when the free GPUs cannot hold a step, the deployment with the higher ``priority`` (at equal
  priority, the larger backlog per GPU) takes one replica from an idle or lower-priority deployment of the same
  GPU class, never below its ``min_replicas``, one move at a time, each side's decision explained.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..config import Config
from .model import AutoscaleSettings, DeploymentView, ReplicaCounts, ScaleDecision, ScaleKind
from .trend import Forecast, LoadTrend

DOWN_FRACTION = 0.7  # a step down leaves every signal under 70% of its target: room before the next step up
# The busy load is an average with little noise left and steps up on its forecast: a narrower band keeps the step
# down near the oracle's (replica-seconds) while one fewer stays well clear of the next step up.
BUSY_DOWN_FRACTION = 0.85
DEFAULT_HISTORY = 500  # decisions kept for /admin/autoscale, ``llmgw status`` and /ui
QUIET_AFTER = 60.0  # seconds steady after which the same wait is recorded again
BACKLOG_SLACK = 0.05  # a measured demand within 5% of a whole number of replicas is that number (rates are noisy)
SATURATED = 0.9  # the ready replicas' busy seats, over the window, from which a backlog measures their drain
# A busy need already pending holds while its forecast stays over this share of the target (a Schmitt trigger):
# the forecast of a ramp hovers about the target for a while, and each dip would restart ``scale_up_after``.
BUSY_HOLD = 0.9


def clamp(value: int, settings: AutoscaleSettings) -> int:
    """``value`` within the deployment's ``min_replicas`` .. ``max_replicas``."""
    return max(settings.min_replicas, min(settings.max_replicas, value))


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def change_of(decision: ScaleDecision) -> str:
    """``up 2 -> 5``, ``holds at 3``: what a decision does, for a log line or a table."""
    if decision.kind == "hold":
        return f"holds at {decision.desired}"
    return f"{decision.kind} {decision.current} -> {decision.desired}"


@dataclass(slots=True)
class _Memory:
    """What the scaler remembers of one deployment between calls."""

    first_seen: float
    desired: int | None = None  # the last count decided (None: not decided yet, the control plane's stands)
    up_since: float | None = None  # since when more replicas have been needed, without a break
    down_since: float | None = None  # since when one fewer would do, without a break and with nothing in flight
    last_step: float | None = None
    hold: str = "steady"  # the topic of the last hold recorded: a hold is recorded when it changes
    steady_since: float | None = None  # since when nothing has waited
    trend: LoadTrend = dataclasses.field(default_factory=LoadTrend)  # the busy load's window (the forecast)
    forecast: Forecast | None = None  # the last one made (``status``)


@dataclass(frozen=True, slots=True)
class Need:
    """The replicas the load asks for, and the sentence saying which signal asks."""

    replicas: int
    reason: str
    proven: bool  # by the queue (a count of work), which may step while another step is in flight


@dataclass(frozen=True, slots=True)
class _Proposal:
    """A step one deployment would take, before the free GPUs are counted."""

    view: DeploymentView
    current: int
    desired: int
    kind: ScaleKind
    reason: str
    why: str = ""  # the need alone, without the step: what a partial step or a move explains itself with


@dataclass(frozen=True, slots=True)
class _Move:
    """A cross-model move in flight: ``taker`` runs ``target`` replicas once its new one is ready."""

    taker: str
    giver: str
    target: int


def _fraction(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(value) else min(1.0, max(0.0, value))


def sane(view: DeploymentView) -> DeploymentView:
    """``view`` with signals a decision can trust: counts at least 0, fractions within 0..1, a NaN as unknown (the
    load reports behind the signals are written by other processes)."""
    signals, counts = view.signals, view.counts
    return dataclasses.replace(
        view, desired=max(0, view.desired), gpus_per_replica=max(0, view.gpus_per_replica),
        counts=ReplicaCounts(*(max(0, n) for n in (counts.ready, counts.starting, counts.draining,
                                                   counts.unplaceable))),
        signals=dataclasses.replace(
            signals, queued=max(0, signals.queued), inflight=max(0, signals.inflight),
            kv_usage=_fraction(signals.kv_usage), ttft_attainment=_fraction(signals.ttft_attainment),
            busy=None if signals.busy is None or not math.isfinite(signals.busy)
            else min(float(counts.ready), max(0.0, signals.busy)),
            last_request_at=signals.last_request_at if signals.last_request_at is None
            or math.isfinite(signals.last_request_at) else None))


def backlog_per_gpu(view: DeploymentView) -> float:
    """Queued requests per GPU the deployment holds (its first replica's GPUs when it has none)."""
    gpus = max(1, view.counts.provisioned) * max(1, view.gpus_per_replica)
    return view.signals.queued / gpus


def is_idle(view: DeploymentView) -> bool:
    return view.signals.queued == 0 and view.signals.inflight == 0


def step_in_flight(view: DeploymentView, current: int) -> bool:
    """A replica starting, or one decided that has not started yet (placing, or no GPU fits it)."""
    return view.counts.starting > 0 or current > view.counts.provisioned


def settling(view: DeploymentView, current: int) -> bool:
    """A step whose effect the signals cannot show yet: replicas starting or not yet placed (the unplaceable ones
    never will, so they do not hold a step down back)."""
    return view.counts.starting > 0 or current > view.counts.provisioned + view.counts.unplaceable


def measured_demand(view: DeploymentView, forecast: Forecast | None = None) -> tuple[float, float] | None:
    """(requests/s arriving, requests/s one ready replica serves) while a backlog shows the ready replicas
    saturated; None before any replica is ready or has finished a request (e.g. ``llmgw plan``'s load), and when
    the busy load's window (``forecast``) says they are not: a request held for a moment while one replica's seats
    were full is no saturation, and the drain of replicas with seats free is no measure of what one serves."""
    signals, counts = view.signals, view.counts
    if not signals.queued or counts.ready == 0 or signals.served_per_s <= 0:
        return None
    if forecast is not None and forecast.level < SATURATED * counts.ready:
        return None
    # Unknown arrivals (a source that does not count them): with a queue, at least what is served. Known, they
    # are the demand: what the replicas drain beyond them is the backlog.
    demand = signals.arrivals_per_s if signals.arrivals_per_s > 0 else signals.served_per_s
    # Per ready replica-second when the source measures it: the replicas ready now include any that just became
    # ready and have finished nothing yet, which would halve the rate and double the need (a cascade).
    per_replica = signals.served_per_replica_s if signals.served_per_replica_s > 0 else \
        signals.served_per_s / counts.ready
    return demand, per_replica


def serving(demand: float, per_replica: float) -> int:
    """The replicas that serve ``demand`` at ``per_replica`` each (within :data:`BACKLOG_SLACK`: rates are noisy)."""
    return max(1, math.ceil(demand / per_replica - BACKLOG_SLACK))


def backlog_cap(view: DeploymentView, current: int, forecast: Forecast | None = None) -> tuple[float, str]:
    """The most replicas a backlog can prove, and the sentence saying why: a backlog that piled up while nothing
    could serve it (a cold start) is no measure of demand, so the replicas it asks for are those that serve the
    arrivals at the rate the ready replicas drain, plus one that drains the backlog (never a cascade from zero).
    Before any replica is ready nothing is measured: the first one starts alone. Without a drain rate (nothing
    finished yet) the backlog's own count stands."""
    if view.counts.ready == 0:
        held = max(1, current)
        return held, (f"no replica is ready to measure its rate yet, so the backlog proves no more than "
                      f"{plural(held, 'replica')}")
    measured = measured_demand(view, forecast)
    if measured is None:
        return math.inf, ""
    demand, per_replica = measured
    cap = serving(demand, per_replica) + 1
    return cap, (f"{demand:.2f} requests/s arriving at {per_replica:.2f}/s per ready replica need "
                 f"{plural(cap - 1, 'replica')}, plus one to drain the backlog")


def need_of(view: DeploymentView, current: int, *, proven_only: bool = False,
            forecast: Forecast | None = None, pending: bool = False) -> Need:
    """The replicas the load asks for (before ``max_replicas``); ``current`` when nothing asks for more.
    ``proven_only``: the queue's need alone (while a step is in flight); ``forecast``: the busy load's;
    ``pending``: a need for more already holds (the busy target is then :data:`BUSY_HOLD` of itself)."""
    settings, signals, counts = view.settings, view.signals, view.counts
    provisioned = counts.provisioned
    needs = [Need(current, "", False)]
    if signals.queued:
        by_queue = math.ceil(signals.queued / settings.queued_per_replica)
        cap, bound = backlog_cap(view, current, forecast)
        reason = (f"{plural(signals.queued, 'request')} queued over {plural(provisioned, 'provisioned replica')} "
                  f"(target {settings.queued_per_replica:g} per replica)")
        needs.append(Need(int(min(by_queue, cap)), f"{reason}; {bound}" if cap < by_queue else reason, True))
        measured = measured_demand(view, forecast)
        if measured is not None:  # saturated replicas and a backlog: the arrivals say how many, before it piles up
            demand, per_replica = measured
            needs.append(Need(serving(demand, per_replica),
                              f"{demand:.2f} requests/s arriving, over the {per_replica:.2f}/s a "
                              f"ready replica serves (a backlog of {plural(signals.queued, 'request')})", True))
    if proven_only:
        return max(needs, key=lambda need: need.replicas)
    if signals.kv_usage is not None and counts.ready and signals.kv_usage > settings.kv_usage:
        by_kv = math.ceil(counts.ready * signals.kv_usage / settings.kv_usage)
        needs.append(Need(by_kv, f"KV usage {signals.kv_usage:.2f} over {plural(counts.ready, 'ready replica')} "
                                 f"> target {settings.kv_usage:g}", False))
    if settings.ttft_slo is not None and signals.ttft_attainment is not None \
            and signals.ttft_attainment < settings.attainment:
        needs.append(Need(provisioned + 1, f"TTFT attainment {signals.ttft_attainment:.1%} of {settings.ttft_slo:g} s "
                                           f"< target {settings.attainment:.0%}", False))
    if forecast is not None:
        target = settings.utilisation * (BUSY_HOLD if pending else 1.0)
        by_busy = math.ceil(forecast.ahead / target - BACKLOG_SLACK)
        if by_busy > provisioned:
            needs.append(Need(by_busy, f"{forecast.describe(settings.lookahead)}: over {settings.utilisation:.0%} "
                                       f"of {plural(provisioned, 'provisioned replica')}", False))
    return max(needs, key=lambda need: (need.replicas, need.proven))


def why_not_fewer(view: DeploymentView, current: int, forecast: Forecast | None = None) -> str | None:
    """None when the load would stay under :data:`DOWN_FRACTION` of every known target with one replica fewer
    (the busy load ``forecast`` under :data:`BUSY_DOWN_FRACTION` of ``utilisation``); else the signal that would
    not (the hysteresis of a step down)."""
    settings, signals, counts = view.settings, view.signals, view.counts
    fewer = current - 1
    if fewer < 1:
        return "one replica is the least a step down leaves (to zero is idle_to_zero's)"
    if signals.queued > DOWN_FRACTION * settings.queued_per_replica * fewer:
        return f"{plural(signals.queued, 'request')} queued would be over {DOWN_FRACTION:.0%} of the target"
    if forecast is not None and forecast.ahead > BUSY_DOWN_FRACTION * settings.utilisation * fewer:
        return (f"{forecast.describe(settings.lookahead)} would be over {BUSY_DOWN_FRACTION:.0%} of the "
                f"{settings.utilisation:.0%} utilisation target")
    if signals.kv_usage is None:
        if signals.inflight and forecast is None:
            return "no KV usage or busy reading: a busy deployment is not stepped down blind"
    elif counts.ready > 1 and signals.kv_usage * counts.ready / (counts.ready - 1) \
            > DOWN_FRACTION * settings.kv_usage:
        return f"KV usage {signals.kv_usage:.2f} would be over {DOWN_FRACTION:.0%} of {settings.kv_usage:g}"
    if settings.ttft_slo is not None and signals.ttft_attainment is not None \
            and signals.ttft_attainment < settings.attainment:
        return f"TTFT attainment {signals.ttft_attainment:.1%} is under its target"
    return None


def down_evidence(view: DeploymentView, current: int, forecast: Forecast | None = None) -> str:
    signals, counts = view.signals, view.counts
    kv = ("no KV reading" + ("" if forecast is not None else ", nothing in flight")) if signals.kv_usage is None \
        else f"KV usage {signals.kv_usage:.2f} over {plural(counts.ready, 'ready replica')}"
    busy = "" if forecast is None else (f", {forecast.describe(view.settings.lookahead)}, "
                                        f"{forecast.ahead / (current - 1):.0%} of one fewer's seats "
                                        f"(under {BUSY_DOWN_FRACTION:.0%} of the {view.settings.utilisation:.0%} "
                                        "utilisation target)")
    return (f"{plural(signals.queued, 'request')} queued and {kv}{busy}: one replica fewer stays under "
            f"{DOWN_FRACTION:.0%} of the targets")


def down_wait(settings: AutoscaleSettings, forecast: Forecast | None) -> float:
    """How long a need for fewer must hold: ``scale_down_after``, or ``lookahead`` when the busy load's window
    proves a fall (a cold start ahead it is lower still)."""
    return min(settings.scale_down_after, settings.lookahead) if forecast is not None and forecast.falling \
        else settings.scale_down_after


class _GpuPool:
    """The free GPUs by class as steps take them, within one call of :meth:`TargetScaler.decide`."""

    def __init__(self, free: Mapping[str | None, int]):
        self.free = dict(free)
        if None not in self.free:
            self.free[None] = sum(self.free.values())

    def available(self, gpu_class: str | None) -> int:
        total = self.free[None]
        return total if gpu_class is None else min(total, self.free.get(gpu_class, 0))

    def take(self, gpu_class: str | None, gpus: int) -> None:
        self.free[None] -= gpus
        if gpu_class is not None and gpu_class in self.free:
            self.free[gpu_class] -= gpus

    def describe(self, gpu_class: str | None) -> str:
        return plural(self.available(gpu_class), "free GPU") + (f" of class {gpu_class}" if gpu_class else "")


class TargetScaler:
    """The :class:`~llmgw.autoscale.interfaces.Scaler` of llmgw (one per leader term: a new leader's starts from
    the counts the control plane adopted, given as each view's ``desired``)."""

    def __init__(self, settings: Mapping[str, AutoscaleSettings] | None = None, *,
                 history_size: int = DEFAULT_HISTORY):
        self._settings = dict(settings or {})
        self._memory: dict[str, _Memory] = {}
        self._history: deque[ScaleDecision] = deque(maxlen=history_size)
        self._move: _Move | None = None

    @classmethod
    def from_config(cls, config: Config) -> TargetScaler:
        """The scaler of ``config``'s autoscaled deployments, keeping ``autoscale.history`` decisions."""
        return cls(config.autoscale_settings(), history_size=config.autoscale.history)

    # -- the Scaler protocol ---------------------------------------------------------------------------------------

    def desired(self, key: str, configured: int) -> int:
        memory = self._memory.get(key)
        if memory is not None and memory.desired is not None:
            return memory.desired
        settings = self._settings.get(key)
        return configured if settings is None or not settings.autoscaled else clamp(configured, settings)

    def history(self, key: str | None = None) -> list[ScaleDecision]:
        return [d for d in self._history if key is None or d.key == key or d.taken_from == key]

    def status(self, now: float) -> dict[str, Any]:
        """What the scaler is waiting for, as plain values for /admin/autoscale and ``llmgw status``: per
        deployment its desired count, why it waits (``waiting``: ``up_pending``, ``down_pending``, ``in_flight``,
        ``no_gpus``, ``at_max``, or None), for how long a need has held and since the last step; the move between
        deployments in flight."""
        def age(at: float | None) -> float | None:
            return None if at is None else round(now - at, 3)

        return {
            "deployments": {key: {
                "desired": memory.desired, "waiting": None if memory.hold == "steady" else memory.hold,
                "up_need_for": age(memory.up_since), "down_need_for": age(memory.down_since),
                "since_last_step": age(memory.last_step),
                "busy": None if memory.forecast is None else {
                    "level": round(memory.forecast.level, 3), "ahead": round(memory.forecast.ahead, 3),
                    "rise_per_s": round(memory.forecast.rise_per_s, 5), "falling": memory.forecast.falling},
            } for key, memory in sorted(self._memory.items())},
            "move": None if self._move is None else dataclasses.asdict(self._move),
        }

    def decide(self, now: float, deployments: Sequence[DeploymentView],
               free_gpus: Mapping[str | None, int]) -> list[ScaleDecision]:
        views = [sane(view) for view in deployments if view.settings.autoscaled]
        self._settings = {view.key: view.settings for view in views}  # a deployment no longer autoscaled: none
        for gone in set(self._memory) - {view.key for view in views}:
            del self._memory[gone]
        decisions: list[ScaleDecision] = []
        proposals: list[_Proposal] = []
        for view in views:
            memory = self._remember(view, now)
            outcome = self._propose(view, memory, now)
            if isinstance(outcome, _Proposal):
                proposals.append(outcome)
            else:
                decisions += self._hold(view, memory, now, *outcome)
        self._settle_move({view.key: view for view in views})
        decisions += self._allot(now, proposals, views, _GpuPool(free_gpus))
        self._history.extend(decisions)
        return decisions

    # -- one deployment --------------------------------------------------------------------------------------------

    def _remember(self, view: DeploymentView, now: float) -> _Memory:
        """The deployment's memory; at first sight it adopts the count the control plane runs (a new leader's
        scaler starts from the replicas running, never from ``min``)."""
        memory = self._memory.get(view.key)
        if memory is None:
            memory = self._memory[view.key] = _Memory(first_seen=now, desired=view.desired)
        return memory

    def _propose(self, view: DeploymentView, memory: _Memory, now: float) -> _Proposal | tuple[str, str]:
        """The step this deployment would take now, or the (topic, reason) of why it holds."""
        settings, signals = view.settings, view.signals
        current = view.desired if memory.desired is None else memory.desired
        bounded = clamp(current, settings)
        if bounded != current:
            return _Proposal(view, current, bounded, "up" if bounded > current else "down",
                             f"{current} replicas is outside the config's {settings.min_replicas}.."
                             f"{settings.max_replicas}: now {bounded}")
        if current == 0 and not is_idle(view):
            return _Proposal(view, 0, 1, "from_zero",
                             f"{plural(signals.queued, 'request')} waiting for {view.model}, which has no replica: "
                             "starting one at once")
        idle_since = signals.last_request_at if signals.last_request_at is not None else memory.first_seen
        idle_since = max(idle_since, memory.last_step if memory.last_step is not None else idle_since)
        if current > settings.min_replicas and is_idle(view) and now - idle_since >= settings.idle_to_zero:
            return _Proposal(view, current, settings.min_replicas,
                             "to_zero" if settings.min_replicas == 0 else "down",
                             f"no request for {view.model} for {now - idle_since:.0f} s (idle_to_zero "
                             f"{settings.idle_to_zero:g} s): back to min {settings.min_replicas}")
        if signals.busy is not None:
            memory.trend.add(now, signals.busy, settings.lookahead)
        forecast = memory.forecast = memory.trend.forecast(now, settings.lookahead)
        in_flight = step_in_flight(view, current)
        need = need_of(view, current, proven_only=in_flight, forecast=forecast, pending=memory.up_since is not None)
        if in_flight and need.replicas <= current:
            unseen = need_of(view, current, forecast=forecast)
            if unseen.replicas > current:
                memory.up_since = memory.down_since = None
                return "in_flight", (f"{unseen.reason}, but a step is in flight ({view.counts.starting} starting, "
                                     f"{view.counts.provisioned} of {current} provisioned): these signals cannot see "
                                     "it yet, so no further step until it is ready")
        target = min(need.replicas, settings.max_replicas)
        if target > current:
            memory.down_since = None
            memory.up_since = now if memory.up_since is None else memory.up_since
            held = now - memory.up_since
            if held >= settings.scale_up_after:
                why = f"{need.reason} for {held:.1f} s"
                return _Proposal(view, current, target, "up", f"{why}: {current} -> {target} replicas", why)
            return "up_pending", (f"{need.reason}: {target} replicas needed, stepping up if it holds for "
                                  f"{settings.scale_up_after:g} s")
        memory.up_since = None
        if need.replicas > current:
            return "at_max", f"{need.reason}: {need.replicas} replicas needed, capped at max {settings.max_replicas}"
        blocker = why_not_fewer(view, current, forecast) if current > settings.min_replicas else "at min"
        if blocker is not None or settling(view, current):
            memory.down_since = None
            return "steady", ""
        memory.down_since = now if memory.down_since is None else memory.down_since
        since = max(memory.down_since, memory.last_step if memory.last_step is not None else memory.down_since)
        wait = down_wait(settings, forecast)
        if now - since >= wait:
            return _Proposal(view, current, current - 1, "down", f"{down_evidence(view, current, forecast)} for "
                                                                 f"{now - since:.0f} s: {current} -> {current - 1}")
        return "down_pending", (f"{down_evidence(view, current, forecast)}: stepping down to {current - 1} if it "
                                f"holds for {wait:g} s")

    def _hold(self, view: DeploymentView, memory: _Memory, now: float, topic: str,
              reason: str) -> list[ScaleDecision]:
        """A hold decision when why it waits changed (not at every call, nor when a signal flickers about its
        target: the history would fill with them). Being steady is not recorded; after :data:`QUIET_AFTER` of
        it, the next wait is recorded again even when it is the one before."""
        if topic == "steady":
            memory.steady_since = now if memory.steady_since is None else memory.steady_since
            if now - memory.steady_since >= QUIET_AFTER:
                memory.hold = "steady"
            return []
        memory.steady_since = None
        if topic == memory.hold:
            return []
        memory.hold = topic
        current = view.desired if memory.desired is None else memory.desired
        return [ScaleDecision(view.key, view.model, now, current, current, "hold", reason)]

    # -- the fleet: free GPUs and cross-model moves ----------------------------------------------------------------

    def _settle_move(self, views: Mapping[str, DeploymentView]) -> None:
        move = self._move
        if move is None:
            return
        taker, giver = views.get(move.taker), views.get(move.giver)
        taker_desired = self.desired(move.taker, 0)
        if taker is None or giver is None or taker.counts.ready >= move.target or taker_desired < move.target:
            self._move = None
        elif taker.counts.starting == 0 and taker.counts.unplaceable and giver.counts.draining == 0:
            self._move = None  # the giver's GPUs are free and still no replica fits: the next move may try again

    def _allot(self, now: float, proposals: list[_Proposal], views: list[DeploymentView],
               pool: _GpuPool) -> list[ScaleDecision]:
        """Every proposal that frees GPUs or fits the free ones is taken; a step up that does not fit may take a
        replica from another deployment (one move at a time); else it holds, saying why."""
        decisions: list[ScaleDecision] = []
        shrinking = {p.view.key for p in proposals if p.desired <= p.current}  # they give nothing more
        givers: set[str] = set()
        order = sorted(proposals, key=lambda p: (p.desired > p.current, -p.view.settings.priority,
                                                 -backlog_per_gpu(p.view), p.view.key))
        for proposal in order:
            view, extra = proposal.view, proposal.desired - proposal.current
            if view.key in givers:
                continue  # it gave a replica to a deployment before it in the order: its own step waits
            if extra <= 0:
                decisions.append(self._step(now, proposal))
                continue
            gpus = max(view.gpus_per_replica, 0)
            fits = extra if gpus == 0 else min(extra, pool.available(view.gpu_class) // gpus)
            if fits == extra:
                pool.take(view.gpu_class, extra * gpus)
                decisions.append(self._step(now, proposal))
            elif fits > 0:
                pool.take(view.gpu_class, fits * gpus)
                desired = proposal.current + fits
                decisions.append(self._step(now, _Proposal(
                    view, proposal.current, desired, proposal.kind,
                    f"{proposal.why or proposal.reason}: {proposal.current} -> {desired} replicas ({proposal.desired} "
                    f"needed; only {fits} more fit the free GPUs)")))
            else:
                decisions += self._take_or_hold(now, proposal, views, pool, shrinking | givers, givers)
        return decisions

    def _take_or_hold(self, now: float, proposal: _Proposal, views: list[DeploymentView], pool: _GpuPool,
                      busy: set[str], givers: set[str]) -> list[ScaleDecision]:
        view = proposal.view
        memory = self._memory[view.key]
        short = (f"{proposal.why or proposal.reason}, but {pool.describe(view.gpu_class)} and a replica needs "
                 f"{plural(view.gpus_per_replica, 'GPU')}")
        if self._move is not None:
            return self._hold(view, memory, now, "no_gpus", f"{short}; another move between deployments "
                                                            f"({self._move.giver} -> {self._move.taker}) is in flight")
        giver = self._giver(view, views, pool, busy)
        if giver is None:
            return self._hold(view, memory, now, "no_gpus", f"{short}, and no idle or lower-priority deployment of "
                                                            "its GPU class is above its min to give one")
        giver_current = self.desired(giver.key, giver.desired)
        why = "idle" if is_idle(giver) else f"priority {giver.settings.priority} < {view.settings.priority}"
        take = ScaleDecision(view.key, view.model, now, proposal.current, proposal.current + 1, "take",
                             f"{short}: taking one from {giver.key} ({why}): {proposal.current} -> "
                             f"{proposal.current + 1}", taken_from=giver.key)
        give = ScaleDecision(giver.key, giver.model, now, giver_current, giver_current - 1, "give",
                             f"gives a replica to {view.key} ({why}; {view.key}: {proposal.why or proposal.reason}): "
                             f"{giver_current} -> {giver_current - 1}, drained first")
        self._move = _Move(view.key, giver.key, proposal.current + 1)
        givers.add(giver.key)
        self._record_step(view.key, now, take.desired)
        self._record_step(giver.key, now, give.desired)
        return [take, give]

    def _giver(self, taker: DeploymentView, views: list[DeploymentView], pool: _GpuPool,
               busy: set[str]) -> DeploymentView | None:
        """The deployment that gives ``taker`` a replica: idle first, then the lowest priority, then the smallest
        backlog per GPU; of ``taker``'s GPU class, above its own min, its replica's GPUs enough for one of
        ``taker``'s."""
        free = pool.available(taker.gpu_class)
        candidates = [
            view for view in views
            if view.key != taker.key and view.key not in busy
            and (taker.gpu_class is None or view.gpu_class == taker.gpu_class)
            and self.desired(view.key, view.desired) > view.settings.min_replicas
            and view.gpus_per_replica + free >= taker.gpus_per_replica
            and (is_idle(view) or view.settings.priority < taker.settings.priority)]
        if not candidates:
            return None
        return min(candidates, key=lambda v: (not is_idle(v), v.settings.priority, backlog_per_gpu(v), v.key))

    def _step(self, now: float, proposal: _Proposal) -> ScaleDecision:
        view = proposal.view
        self._record_step(view.key, now, proposal.desired)
        return ScaleDecision(view.key, view.model, now, proposal.current, proposal.desired, proposal.kind,
                             proposal.reason)

    def _record_step(self, key: str, now: float, desired: int) -> None:
        memory = self._memory[key]
        memory.desired, memory.last_step, memory.hold, memory.steady_since = desired, now, "steady", None
        memory.up_since = memory.down_since = None
