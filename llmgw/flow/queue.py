"""The gateway queue (:class:`~.interfaces.FlowControl`): per model, strict priority bands, fair shares by tokens
within a band, deadlines, overflow, and a Retry-After from the measured drain rate.

- A request is admitted at once, without awaiting, when its model has room for its class
  (``room.admits(model, class, pending, pending tokens + its cost, their output + its output)``:
  ``room.free(model, class) - pending > 0`` and ``room.fits(...)`` on the tokens, in one pass;
  *pending*: admitted here and not yet released, counted in requests and in tokens, of which the output allowance
  apart: the room scales the prompt estimate alone) and nothing of its class or a higher one waits.
- Otherwise it waits in its band (:class:`~.fair.FairBand`: start-time fair queueing by tokens between flows,
  FCFS within one). A dispatcher task per model, started when the model first has a waiter and ending when it has
  none, admits waiters while there is room: the highest band first, a lower band only when every band above it is
  empty. It wakes on ``room.changed(model)``, an arrival and a release.
- A request is shed (:class:`~.model.Shed`, 429) at once on arrival when its predicted wait, times the factor its
  class's predictions were measured wrong by, passes what its deadline leaves (UNSERVABLE; :mod:`.shedding`: the
  bands above drained at their rates, then what of its own band the fair order puts before it,
  :meth:`~.fair.FairBand.tokens_before`: a light tenant arriving behind a heavy one's burst is not shed for the
  burst; the factor, :class:`~.shedding.WaitErrors`, learnt from each waiter's wait against its prediction);
  never while no drain rate is measured,
  nor when the model has room for it and all waiting ahead of it. A waiter is shed the same way while it waits
  (looked at every ``RECHECK`` seconds) once its predicted wait passes ``RECHECK_FACTOR`` times what it has left
  (a higher class arrived ahead of it, the drain slowed); else when its deadline passes (EXPIRED); or when the
  model's queue is over ``max_queued`` requests or ``max_queued_tokens`` (OVERFLOW: the newest waiter of the
  lowest band, maybe the one arriving). Each early shed is judged afterwards (``llmgw_flow_early_shed_verdicts``).
- A stall in progress counts on arrival (and in Retry-After): while requests wait and nothing has been dispatched
  for *s* seconds (the room full of long streams), an arrival's predicted wait is at least *s* (a stall that has
  lasted *s* is expected to last about as long again): the drain rate, an average over dispatches, does not see a
  stall until it ends, and the requests arriving late in one would otherwise wait for their deadline and expire,
  the slow refusals of issue 31 through several gateways. Not in the looks at the waiters: near its deadline a
  waiter has so little left that any pause between two dispatches would shed it.
- Nothing is shed early while a replica of the model takes the held requests in a ramp (``room.ramping(model)``,
  :mod:`.ramp`): their dispatch is paced, a few at first, so the drain rate it measures would shed most of a
  held burst the moment its first replica appears (the bench's start from zero: 52 of 79 held, before this).
  Deadlines and the queue's bounds still hold.
- Retry-After: the same estimate for all that waits in the shed request's band and above, rounded up and clamped
  to ``[retry_after_min, retry_after_max]`` (``retry_after_min`` while the rate is unknown).
- Among several gateways (``peers``), a band whose rate this gateway does not trust yet drains at its share of the
  rate the others trust (:mod:`.cluster_drain`): a gateway that sees a third of the arrivals sheds as soon as the
  cluster has measured enough, not a third as soon. What this gateway publishes is its own rate alone
  (:meth:`FlowQueue.trusted_drains`).

The dispatchers run in :meth:`FlowQueue.run`'s nursery (a :class:`~llmgw.control.tasks.TaskHost`), which the
gateway starts in its own.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import deque
from typing import NamedTuple

import trio

from ..control.tasks import TaskHost
from ..lograte import RepeatLimitedLog
from .cluster_drain import PeerDrains, share_of_cluster
from .drain import DrainRate
from .fair import FairBand
from .interfaces import Room
from .metrics import FlowMetrics
from .model import EXPIRED, OVERFLOW, UNSERVABLE, Admitted, FlowRequest, FlowSettings, PriorityClass, Shed
from .shedding import BandDrain, drain_time, unservable_on_arrival

log = logging.getLogger(__name__)

POLL = 0.25  # seconds a dispatcher waits at most for a wake-up before looking at the room again
RECHECK = 0.1  # seconds between two looks at the waiters' predicted waits
# A request is shed on arrival when its predicted wait times a learnt factor passes its deadline (.shedding's
# unservable_on_arrival); a waiter is shed only when its predicted wait passes its deadline by this factor: a real
# change (a higher class arrived ahead of it, the drain slowed), not the noise of the estimate it was admitted on.
RECHECK_FACTOR = 1.5
RECHECK_MAX = 1000  # waiters of a band looked at per look at most (its newest: the most ahead of them)
RECENT = 60.0  # seconds of sheds the snapshot counts
RECENT_KEPT = 256  # sheds remembered per model and class for it
MAX_MODELS = 1024  # models with nothing waiting or admitted are forgotten beyond it


def _times(value: float | None) -> str:
    return "not learnt" if value is None else f"{value:.2f}x"


def _output_of(request: FlowRequest) -> int:
    """Of the request's cost, its output allowance: within 0..cost whatever the caller gave."""
    return min(max(request.output, 0), max(request.cost, 0))


def _room_cost(request: FlowRequest) -> int:
    """The tokens the room counts for the request: its prompt in the router's estimate and its output allowance
    (its cost when the prompt is not given apart)."""
    if request.prompt is None:
        return max(request.cost, 0)
    return max(request.prompt, 0) + _output_of(request)


class Queued(NamedTuple):
    """What waits for a model in one class."""

    requests: int
    tokens: int


class _Waiter:
    __slots__ = ("request", "since", "event", "outcome", "position", "tokens_ahead", "ahead_class", "target",
                 "start", "predicted")

    def __init__(self, request: FlowRequest, since: float, position: int, tokens_ahead: int, ahead_class: str,
                 target: int, start: float, predicted: float | None):
        self.request = request
        self.since = since
        self.event = trio.Event()
        self.outcome: Admitted | Shed | None = None
        self.position, self.tokens_ahead, self.ahead_class = position, tokens_ahead, ahead_class
        self.target = target  # its band's served tokens once those the fair order put before it have gone
        self.start = start  # its virtual start in its band's fair order
        # The wait predicted on its arrival (None: no rate known, or room for it and all ahead of it then)
        self.predicted = predicted

    # What the fair band orders by.
    @property
    def flow(self) -> str:
        return self.request.flow

    @property
    def cost(self) -> int:
        return max(self.request.cost, 0)  # an estimate below 0 would give its flow credit

    @property
    def output(self) -> int:
        return _output_of(self.request)

    @property
    def weight(self) -> float:
        return self.request.weight


class _ClassState:
    __slots__ = ("requests", "tokens", "sheds")

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0
        self.sheds: deque[tuple[float, str]] = deque(maxlen=RECENT_KEPT)


class _Band:
    """One class's band of a model's queue: its fair order and its drain."""

    __slots__ = ("rank", "fair", "line")

    def __init__(self, rank: int):
        self.rank = rank
        self.fair: FairBand[_Waiter] = FairBand()
        self.line = BandDrain()


class _Model:
    """One model's queue."""

    def __init__(self, name: str, ranks: list[int], peers: PeerDrains | None = None):
        self.name = name
        self.peers = peers
        self.bands: list[_Band] = [_Band(rank) for rank in sorted(set(ranks))]
        self.classes: dict[str, _ClassState] = {}
        self.pending = 0  # admitted, not yet released
        self.entered = 0  # requests that entered (the autoscaler's arrival rate)
        self.pending_tokens = 0  # their tokens as the room counts them (_room_cost)
        self.pending_output = 0  # of those, their output allowances
        self.waiting = 0
        self.tokens = 0
        self.drain = DrainRate()
        self.dispatches = DrainRate()  # the same in requests: what a band's rate is until it is measured
        self.kick = trio.Event()  # set on an arrival or a release: the dispatcher looks again
        self.dispatching = False
        self.rechecked = 0.0  # when the waiters' predicted waits were last looked at
        self.moved = 0.0  # the last dispatch while requests waited, or when they began to wait

    def band(self, rank: int) -> _Band:
        for band in self.bands:
            if band.rank == rank:
                return band
        band = _Band(rank)
        self.bands = sorted([*self.bands, band], key=lambda b: b.rank)
        return band

    def waits_at(self, rank: int) -> bool:
        """Whether anything waits at ``rank`` or above."""
        for band in self.bands:
            if band.rank > rank:
                return False
            if len(band.fair):
                return True
        return False

    def ahead(self, rank: int, request: FlowRequest | None = None) -> tuple[int, int, str, int]:
        """The requests and tokens waiting at ``rank`` and above, the highest class among them, and of those
        tokens the ones of ``rank``'s own band. With a ``request`` arriving, the tokens of its own band are only
        those dispatched before it in fair order."""
        requests = tokens = own = 0
        first = ""
        for band in self.bands:
            if band.rank > rank:
                break
            fair = band.fair
            if len(fair):
                requests += len(fair)
                if band.rank == rank:
                    own = fair.tokens_before(request.flow, request.weight) if request is not None else fair.tokens
                    tokens += own
                else:
                    tokens += fair.tokens
                if not first:
                    head = fair.peek()
                    first = head.request.priority.name if head is not None else ""
        return requests, tokens, first, own

    def rate_of(self, band: _Band, now: float, cost: int) -> float | None:
        """``band``'s drain rate in tokens/s: its own once measured, else this gateway's share of the rate the
        other gateways measured for it, else the model's requests per second times the mean cost of what waits in
        it (``cost`` when nothing does)."""
        own = band.line.drain.trusted
        if own is not None:
            return own
        if self.peers is not None:
            cluster = share_of_cluster(self.peers.rates(self.name, band.rank), sum(self.peers.held(self.name)),
                                       self.waiting)
            if cluster is not None:
                return cluster
        requests = self.dispatches.trusted
        if requests is None:
            return None
        fair = band.fair
        mean = fair.tokens / len(fair) if len(fair) else cost
        return requests * max(mean, 1)

    def wait_above(self, rank: int, now: float) -> float | None:
        """Seconds to drain the bands above ``rank`` at their rates (None: a rate unknown)."""
        return drain_time((band.fair.tokens, self.rate_of(band, now, 1)) for band in self.bands if band.rank < rank)

    def head_changed(self, now: float) -> None:
        """Keep each band's drain measuring only while it is the highest band waiting."""
        head = True
        for band in self.bands:
            is_head = head and len(band.fair) > 0
            if is_head != band.line.head:
                band.line.head = is_head
                band.line.drain.backlog(is_head, now)
            if len(band.fair):
                head = False

    def stalled(self, now: float) -> float:
        """Seconds since requests waiting here last saw a dispatch (0 when nothing waits)."""
        return now - self.moved if self.waiting else 0.0

    def state(self, name: str) -> _ClassState:
        state = self.classes.get(name)
        if state is None:
            state = self.classes[name] = _ClassState()
        return state


class _Ticket:
    """An admission's place in its model's room until released."""

    __slots__ = ("model", "tokens", "output", "released")

    def __init__(self, model: _Model, tokens: int, output: int):
        self.model = model
        self.tokens = tokens
        self.output = output
        self.released = False
        model.pending += 1
        model.pending_tokens += tokens
        model.pending_output += output


class FlowQueue(TaskHost):
    """The gateway's :class:`~.interfaces.FlowControl`. ``await nursery.start(queue.run)`` before the first request:
    the per-model dispatchers run in that task's nursery (a request that must wait raises RuntimeError before)."""

    not_running = "FlowQueue.run() is not running: start it in the gateway's nursery first"

    def __init__(self, settings: FlowSettings, room: Room, metrics: FlowMetrics | None = None,
                 peers: PeerDrains | None = None):
        """``peers``: the other gateways' drain rates and held requests (None: a gateway alone)."""
        self.settings = settings
        self.room = room
        self.peers = peers
        self.metrics = metrics or FlowMetrics()
        self._ranks = [c.rank for c in settings.classes]
        self._models: dict[str, _Model] = {}
        self._errors = RepeatLimitedLog(log)

    async def enter(self, request: FlowRequest) -> Admitted | Shed:
        model = self._models.get(request.model)
        if model is None:
            model = self._new_model(request.model)
        model.entered += 1
        priority = request.priority
        cost = max(request.cost, 0)
        output = _output_of(request)
        room_cost = _room_cost(request)
        if (not model.waiting or not model.waits_at(priority.rank)) and self._has_room(model, priority, room_cost,
                                                                                        output):
            # The fast path: no await, no clock unless a backlog is being measured.
            if model.waiting:
                now = trio.current_time()
                model.drain.dispatched(cost, now)
                model.dispatches.dispatched(1, now)
                model.moved = now
            self.metrics.admitted.labels(model.name, priority.name).inc()
            self.metrics.wait.labels(model.name, priority.name).observe(0.0)
            return Admitted(0.0, _Ticket(model, room_cost, output))
        return await self._wait(model, request)

    def entered(self, model: str) -> int:
        """The requests for ``model`` that have entered this queue (a counter; it restarts if the model is
        forgotten, beyond :data:`MAX_MODELS`)."""
        found = self._models.get(model)
        return found.entered if found is not None else 0

    def _has_room(self, model: _Model, priority: PriorityClass, cost: int, output: int, requests: int = 1) -> bool:
        """Room for ``requests`` more requests of ``cost`` tokens in all (``output`` of them output allowance),
        besides those admitted and not yet released."""
        return self.room.admits(model.name, priority, model.pending + requests - 1, model.pending_tokens + cost,
                                model.pending_output + output)

    def _new_model(self, name: str) -> _Model:
        if len(self._models) >= MAX_MODELS:  # the data plane names served models only; still, never grow unbounded
            self._models = {n: m for n, m in self._models.items() if m.waiting or m.pending or m.dispatching}
        model = self._models[name] = _Model(name, self._ranks, self.peers)
        return model

    def release(self, admitted: Admitted) -> None:
        ticket = admitted.ticket
        if not isinstance(ticket, _Ticket) or ticket.released:
            log.error("flow: release of an admission that is not held (released twice, or not this queue's): "
                      "ignored; a bug in the caller")
            return
        ticket.released = True
        model = ticket.model
        model.pending -= 1
        model.pending_tokens -= ticket.tokens
        model.pending_output -= ticket.output
        if model.waiting:
            model.kick.set()

    def trusted_drains(self, model: str) -> tuple[tuple[int, int], ...]:
        """Per band of ``model``, ``(rank, tokens/s)`` of the drain rates this gateway measured and trusts (its
        own alone: what it tells the other gateways)."""
        found = self._models.get(model)
        if found is None:
            return ()
        return tuple((band.rank, int(rate)) for band in found.bands if (rate := band.line.drain.trusted) is not None)

    def queued(self, model: str) -> dict[str, Queued]:
        """Per class name, what waits for ``model`` at this gateway (classes with nothing waiting left out)."""
        queue = self._models.get(model)
        if queue is None:
            return {}
        return {name: Queued(s.requests, s.tokens) for name, s in queue.classes.items() if s.requests}

    def snapshot(self) -> dict[str, dict]:
        """Per model: requests (and their tokens) admitted and not released, the drain rate (tokens/s; None until
        measured), and per class: requests and tokens waiting, the oldest's wait (s), the sheds of the last minute
        by reason."""
        now = trio.current_time()
        out: dict[str, dict] = {}
        for name, model in self._models.items():
            oldest: dict[str, float] = {}
            for band in model.bands:
                for waiter in band.fair:  # oldest first: stop once each class waiting in the band was seen
                    cls = waiter.request.priority.name
                    if cls not in oldest:
                        oldest[cls] = now - waiter.since
                    if len(oldest) == len(model.classes):
                        break
            classes = {}
            for cls, state in model.classes.items():
                recent: dict[str, int] = {}
                for at, reason in state.sheds:
                    if now - at <= RECENT:
                        recent[reason] = recent.get(reason, 0) + 1
                classes[cls] = {"queued": state.requests, "queued_tokens": state.tokens,
                                "oldest_wait": oldest.get(cls, 0.0), "recent_sheds": recent}
            out[name] = {"pending": model.pending, "pending_tokens": model.pending_tokens,
                         "drain_rate": model.drain.current(now), "classes": classes}
        return out

    # The slow path.

    @staticmethod
    def _drain_of(model: _Model, band: _Band, now: float, cost: int) -> tuple[float, float] | None:
        """The seconds to drain the bands above ``band`` and ``band``'s own rate (None: a rate unknown); ``cost``:
        the request's, for a band with nothing waiting."""
        above = model.wait_above(band.rank, now)
        rate = model.rate_of(band, now, cost)
        return None if above is None or rate is None else (above, rate)

    @staticmethod
    def _predicted(drain: tuple[float, float] | None, own_ahead: int, cost: int, stalled: float = 0.0) -> float | None:
        """Seconds until a request with ``own_ahead`` of its band's tokens before it (and ``cost`` of its own)
        would be dispatched: the bands above drained, then its part of its own; at least the ``stalled`` seconds
        the queue has gone without a dispatch (None: a rate unknown)."""
        if drain is None:
            return None
        above, rate = drain
        return max(stalled, above + (own_ahead + cost // 2) / rate if rate > 0 else math.inf)

    async def _wait(self, model: _Model, request: FlowRequest) -> Admitted | Shed:
        if not self.running:
            raise RuntimeError(self.not_running)
        now = trio.current_time()
        priority = request.priority
        band = model.band(priority.rank)
        position, tokens_ahead, ahead_class, own_ahead = model.ahead(priority.rank, request)
        explain = (position, tokens_ahead, ahead_class)
        remaining = request.deadline - now
        if remaining <= 0:
            return self._shed(model, request, EXPIRED, 0.0, "its deadline had passed when it arrived", explain)
        # With room for it and all ahead of it, it is dispatched as soon as the dispatcher runs: never shed early.
        # Those ahead count as prompt (their output is not summed per band): the room they need is over-counted,
        # never under, so a request is at worst looked at by the drain prediction rather than let through.
        expected = None
        if not self._has_room(model, priority, tokens_ahead + max(request.cost, 0), _output_of(request),
                              position + 1) and not self.room.ramping(model.name):
            cost = max(request.cost, 0)
            expected = self._predicted(self._drain_of(model, band, now, cost), own_ahead, cost, model.stalled(now))
            factor = band.line.errors.factor()
            if factor is not None:
                self.metrics.prediction_factor.labels(model.name, priority.name).set(factor)
            if expected is not None and unservable_on_arrival(expected, remaining, factor):
                return self._shed_early(model, band, request, band.fair.start_of(request.flow, request.weight), 0.0,
                                        self._unservable(model, tokens_ahead, expected, remaining), explain)
        if self._overflows(model, request):
            return self._shed(model, request, OVERFLOW, 0.0, self._full(model), explain)
        waiter = _Waiter(request, now, *explain, band.line.served + own_ahead,
                         band.fair.start_of(request.flow, request.weight), expected)
        request.enqueued = now
        self._enqueue(model, waiter, now)
        try:
            with trio.move_on_at(request.deadline):
                await waiter.event.wait()
        except BaseException:  # cancelled (the client left): never keep its place, never leak its slot
            if isinstance(waiter.outcome, Admitted):
                self.release(waiter.outcome)
            elif waiter.outcome is None:
                self._dequeue(model, waiter, trio.current_time())
            raise
        if waiter.outcome is None:
            now = trio.current_time()
            self._dequeue(model, waiter, now)
            self._missed(model, band, waiter, EXPIRED, now)
            waiter.outcome = self._shed(model, request, EXPIRED, now - waiter.since,
                                        f"no room for it on {model.name} within its {priority.name} deadline",
                                        explain)
        return waiter.outcome

    def _missed(self, model: _Model, band: _Band, waiter: _Waiter, reason: str, now: float) -> None:
        """A waiter admitted on a prediction was shed while it waited, or expired: the prediction was wrong."""
        predicted = waiter.predicted
        if predicted is None:
            return
        request = waiter.request
        cls = request.priority.name
        left = request.deadline - waiter.since
        waited = now - waiter.since
        band.line.errors.missed(predicted, left)
        self._prediction_error(model, cls, reason, waited - predicted)
        self._errors.log(logging.INFO, "flow: a %s request to %s predicted on arrival to wait %.2f s of the %.2f s "
                         "its deadline left was shed (%s) after %.2f s; the class's factor on arrival is now %s "
                         "(llmgw_flow_wait_prediction_error_seconds)", cls, model.name, predicted, left, reason,
                         waited, _times(band.line.errors.factor()), kind=f"missed {model.name} {cls}")

    def _prediction_error(self, model: _Model, cls: str, outcome: str, error: float) -> None:
        self.metrics.prediction_error.labels(model.name, cls, outcome).observe(error)

    @staticmethod
    def _unservable(model: _Model, tokens_ahead: int, expected: float, remaining: float) -> str:
        return (f"{tokens_ahead} tokens wait ahead of it for {model.name}: about {expected:.1f} s at the drain "
                f"rates measured, more than the {remaining:.1f} s its deadline leaves")

    def _overflows(self, model: _Model, request: FlowRequest) -> bool:
        """Shed the newest waiters of the lowest bands below ``request``'s until it fits; True: it does not."""
        limit, token_limit = self.settings.max_queued, self.settings.max_queued_tokens
        while model.waiting + 1 > limit or model.tokens + max(request.cost, 0) > token_limit:
            victim = None
            for band in reversed(model.bands):
                if band.rank <= request.priority.rank:
                    break
                if len(band.fair):
                    victim = band.fair.newest()
                    break
            if victim is None:
                return True
            now = trio.current_time()
            self._dequeue(model, victim, now)
            victim.outcome = self._shed(model, victim.request, OVERFLOW, now - victim.since,
                                        self._full(model), (victim.position, victim.tokens_ahead,
                                                            victim.ahead_class))
            victim.event.set()
        return False

    def _full(self, model: _Model) -> str:
        return (f"{model.name}'s queue is full ({model.waiting} requests, {model.tokens} tokens waiting; "
                f"max_queued {self.settings.max_queued}, max_queued_tokens {self.settings.max_queued_tokens})")

    def _enqueue(self, model: _Model, waiter: _Waiter, now: float) -> None:
        request = waiter.request
        model.band(request.priority.rank).fair.push(waiter)
        if not model.waiting:
            model.moved = now
        model.waiting += 1
        model.tokens += waiter.cost
        self._count(model, request.priority.name, 1, waiter.cost)
        model.drain.backlog(True, now)
        model.dispatches.backlog(True, now)
        model.head_changed(now)
        if not model.dispatching:
            model.dispatching = True
            self.spawn(self._dispatch, model)
        else:
            model.kick.set()

    def _dequeue(self, model: _Model, waiter: _Waiter, now: float, *, dispatched: bool = False) -> None:
        request = waiter.request
        band = model.band(request.priority.rank)
        if not dispatched:  # the dispatcher has popped it already
            band.fair.remove(waiter)
        model.waiting -= 1
        model.tokens -= waiter.cost
        self._count(model, request.priority.name, -1, -waiter.cost)
        if dispatched:
            model.moved = now
            model.drain.dispatched(waiter.cost, now)
            model.dispatches.dispatched(1, now)
            band.line.drain.dispatched(waiter.cost, now)
            band.line.served += waiter.cost
        if not model.waiting:
            model.drain.backlog(False, now)
            model.dispatches.backlog(False, now)
        model.head_changed(now)

    def _count(self, model: _Model, cls: str, requests: int, tokens: int) -> None:
        state = model.state(cls)
        state.requests += requests
        state.tokens += tokens
        self.metrics.queued.labels(model.name, cls).set(state.requests)
        self.metrics.queued_tokens.labels(model.name, cls).set(state.tokens)

    def _shed(self, model: _Model, request: FlowRequest, reason: str, waited: float, detail: str,
              explain: tuple[int, int, str]) -> Shed:
        now = trio.current_time()
        retry_after = self._retry_after(model, request.priority, now)
        cls = request.priority.name
        model.state(cls).sheds.append((now, reason))
        self.metrics.shed.labels(model.name, cls, reason).inc()
        self.metrics.retry_after.labels(model.name, cls).observe(retry_after)
        return Shed(reason, retry_after, waited, detail, *explain)

    def _shed_early(self, model: _Model, band: _Band, request: FlowRequest, start: float, waited: float,
                    detail: str, explain: tuple[int, int, str]) -> Shed:
        """Shed UNSERVABLE, leaving a mark to judge later whether it would have been served in time."""
        now = trio.current_time()
        self._verdicts(model, band, band.line.verdicts.mark(start, band.line.served, request.deadline, now))
        return self._shed(model, request, UNSERVABLE, waited, detail, explain)

    def _verdicts(self, model: _Model, band: _Band, verdicts: list[str]) -> None:
        if verdicts:
            cls = self._class_name(band.rank)
            for verdict in verdicts:
                self.metrics.early_shed_verdicts.labels(model.name, cls, verdict).inc()

    def _class_name(self, rank: int) -> str:
        for cls in self.settings.classes:
            if cls.rank == rank:
                return cls.name
        return str(rank)

    def _retry_after(self, model: _Model, priority: PriorityClass, now: float) -> int:
        """The time for all that waits at ``priority``'s band and above to drain, by the same estimate as early
        shedding's, within the bounds (the lower one while it is unknown)."""
        low, high = self.settings.retry_after_min, self.settings.retry_after_max
        band = model.band(priority.rank)
        seconds = self._predicted(self._drain_of(model, band, now, 1), band.fair.tokens, 0, model.stalled(now))
        if seconds is None:
            return low
        return max(low, min(high, math.ceil(seconds) if math.isfinite(seconds) else high))

    # The dispatcher.

    async def _dispatch(self, model: _Model) -> None:
        try:
            while True:
                model.kick = trio.Event()
                try:
                    self._admit_ready(model)
                    self._recheck(model)
                except Exception as exc:  # a broken room must not end the gateway: its waiters expire meanwhile
                    self._errors.error("flow: dispatching %s's queue failed (a bug: please report it); trying again "
                                       "in %.2f s", model.name, POLL, exc_info=exc)
                if not model.waiting:
                    return
                await self._changed(model)
        finally:
            model.dispatching = False

    def _admit_ready(self, model: _Model) -> None:
        """Admit waiters in band and fair order while the room allows; a band only when those above are empty."""
        now = trio.current_time()
        for band in model.bands:
            fair = band.fair
            had = len(fair)
            while (waiter := fair.peek()) is not None:
                priority = waiter.request.priority
                room_cost = _room_cost(waiter.request)
                if not self._has_room(model, priority, room_cost, waiter.output):
                    break
                fair.pop()
                self._dequeue(model, waiter, now, dispatched=True)
                waited = now - waiter.since
                waiter.outcome = Admitted(waited, _Ticket(model, room_cost, waiter.output), waiter.position,
                                          waiter.tokens_ahead, waiter.ahead_class)
                waiter.event.set()
                self.metrics.admitted.labels(model.name, priority.name).inc()
                self.metrics.wait.labels(model.name, priority.name).observe(waited)
                if waiter.predicted is not None:
                    band.line.errors.served(waiter.predicted, waited)
                    self._prediction_error(model, priority.name, "admitted", waited - waiter.predicted)
            if had and not len(fair) and band.line.verdicts.pending:
                self._verdicts(model, band, band.line.verdicts.emptied(now))
            if len(fair):
                break
        self._judge(model, now)
        rate = model.drain.rate
        if rate is not None:
            self.metrics.drain_rate.labels(model.name).set(rate)

    def _judge(self, model: _Model, now: float) -> None:
        """The early sheds' turns that came, and the verdicts of those whose deadline passed, in every band."""
        for band in model.bands:
            marks = band.line.verdicts
            if marks.pending:
                self._verdicts(model, band, marks.judge(band.fair.vnow, band.line.served, now))

    def _recheck(self, model: _Model) -> None:
        """At most every RECHECK seconds, shed (UNSERVABLE) the waiters whose predicted wait now passes
        RECHECK_FACTOR times what they have left: higher classes arrived ahead of them, or the drain slowed. At most
        RECHECK_MAX of each band a look (its newest), so that a long queue costs the loop a bounded time."""
        now = trio.current_time()
        if now - model.rechecked < RECHECK or not model.waiting or self.room.ramping(model.name):
            return
        model.rechecked = now
        above = 0  # the tokens waiting in the bands above
        for band in model.bands:
            drain = self._drain_of(model, band, now, 1) if len(band.fair) else None
            if drain is not None:  # something waits in it, and it has an estimate
                doomed = []
                for waiter in itertools.islice(band.fair.newest_first(), RECHECK_MAX):
                    own_ahead = max(0, waiter.target - band.line.served)
                    expected = self._predicted(drain, own_ahead, waiter.cost)
                    assert expected is not None
                    remaining = waiter.request.deadline - now
                    if expected > RECHECK_FACTOR * remaining:
                        doomed.append((waiter, above + own_ahead, expected, remaining))
                for waiter, tokens, expected, remaining in doomed:
                    self._dequeue(model, waiter, now)
                    self._missed(model, band, waiter, UNSERVABLE, now)
                    waiter.outcome = self._shed_early(
                        model, band, waiter.request, waiter.start, now - waiter.since,
                        self._unservable(model, tokens, expected, remaining),
                        (waiter.position, waiter.tokens_ahead, waiter.ahead_class))
                    waiter.event.set()
            above += band.fair.tokens

    async def _changed(self, model: _Model) -> None:
        """Return on an arrival, a release or the room's change, at the latest after POLL seconds."""
        kick = model.kick
        with trio.move_on_after(POLL):  # a room whose changed() never returns cannot stall the queue
            async with trio.open_nursery() as nursery:
                async def room_changed() -> None:
                    await self.room.changed(model.name)
                    nursery.cancel_scope.cancel()

                nursery.start_soon(room_changed)
                await kick.wait()
                nursery.cancel_scope.cancel()
