"""The gateway queue (:class:`~.interfaces.FlowControl`): per model, strict priority bands, fair shares by tokens
within a band, deadlines, overflow, and a Retry-After from the measured drain rate.

- A request is admitted at once, without awaiting, when its model has room for its class
  (``room.free(model, class) - pending > 0`` and ``room.fits(model, class, pending tokens + its cost)``;
  *pending*: admitted here and not yet released, counted in requests and in tokens) and nothing of its class or a
  higher one waits.
- Otherwise it waits in its band (:class:`~.fair.FairBand`: start-time fair queueing by tokens between flows,
  FCFS within one). A dispatcher task per model, started when the model first has a waiter and ending when it has
  none, admits waiters while there is room: the highest band first, a lower band only when every band above it is
  empty. It wakes on ``room.changed(model)``, an arrival and a release.
- A waiter is shed (:class:`~.model.Shed`, 429) when its deadline passes (EXPIRED); at once when the tokens
  ahead of it would take longer to drain, at the measured rate, than its deadline leaves (UNSERVABLE; never while
  the rate is not yet measured): all those of the bands above, and of its own band those the fair order puts
  before it (:meth:`~.fair.FairBand.tokens_before`: a light tenant arriving behind a heavy one's burst is not
  shed for the burst); or when the model's queue is over ``max_queued``
  requests or ``max_queued_tokens`` (OVERFLOW: the newest waiter of the lowest band, maybe the one arriving).
- Retry-After: the tokens waiting in the shed request's band and above over the drain rate, rounded up and
  clamped to ``[retry_after_min, retry_after_max]`` (``retry_after_min`` while the rate is unknown).

The dispatchers run in :meth:`FlowQueue.run`'s nursery (a :class:`~llmgw.control.tasks.TaskHost`), which the
gateway starts in its own.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import NamedTuple

import trio

from ..control.tasks import TaskHost
from ..lograte import RepeatLimitedLog
from .drain import DrainRate
from .fair import FairBand
from .interfaces import Room
from .metrics import FlowMetrics
from .model import EXPIRED, OVERFLOW, UNSERVABLE, Admitted, FlowRequest, FlowSettings, PriorityClass, Shed

log = logging.getLogger(__name__)

POLL = 0.25  # seconds a dispatcher waits at most for a wake-up before looking at the room again
RECENT = 60.0  # seconds of sheds the snapshot counts
RECENT_KEPT = 256  # sheds remembered per model and class for it
MAX_MODELS = 1024  # models with nothing waiting or admitted are forgotten beyond it


class Queued(NamedTuple):
    """What waits for a model in one class."""

    requests: int
    tokens: int


class _Waiter:
    __slots__ = ("request", "since", "event", "outcome", "position", "tokens_ahead", "ahead_class")

    def __init__(self, request: FlowRequest, since: float, position: int, tokens_ahead: int, ahead_class: str):
        self.request = request
        self.since = since
        self.event = trio.Event()
        self.outcome: Admitted | Shed | None = None
        self.position, self.tokens_ahead, self.ahead_class = position, tokens_ahead, ahead_class

    # What the fair band orders by.
    @property
    def flow(self) -> str:
        return self.request.flow

    @property
    def cost(self) -> int:
        return max(self.request.cost, 0)  # an estimate below 0 would give its flow credit

    @property
    def weight(self) -> float:
        return self.request.weight


class _ClassState:
    __slots__ = ("requests", "tokens", "sheds")

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0
        self.sheds: deque[tuple[float, str]] = deque(maxlen=RECENT_KEPT)


class _Model:
    """One model's queue."""

    def __init__(self, name: str, ranks: list[int]):
        self.name = name
        self.bands: list[tuple[int, FairBand[_Waiter]]] = [(rank, FairBand()) for rank in sorted(set(ranks))]
        self.classes: dict[str, _ClassState] = {}
        self.pending = 0  # admitted, not yet released
        self.entered = 0  # requests that entered (the autoscaler's arrival rate)
        self.pending_tokens = 0  # their costs
        self.waiting = 0
        self.tokens = 0
        self.drain = DrainRate()
        self.kick = trio.Event()  # set on an arrival or a release: the dispatcher looks again
        self.dispatching = False

    def band(self, rank: int) -> FairBand[_Waiter]:
        for r, band in self.bands:
            if r == rank:
                return band
        band = FairBand()
        self.bands = sorted([*self.bands, (rank, band)], key=lambda rb: rb[0])
        return band

    def waits_at(self, rank: int) -> bool:
        """Whether anything waits at ``rank`` or above."""
        for r, band in self.bands:
            if r > rank:
                return False
            if len(band):
                return True
        return False

    def ahead(self, rank: int, request: FlowRequest | None = None) -> tuple[int, int, str]:
        """The requests and tokens waiting at ``rank`` and above, and the highest class among them. With a
        ``request`` arriving, the tokens of its own band are only those dispatched before it in fair order."""
        requests = tokens = 0
        first = ""
        for r, band in self.bands:
            if r > rank:
                break
            if len(band):
                requests += len(band)
                if request is not None and r == rank:
                    tokens += band.tokens_before(request.flow, request.weight)
                else:
                    tokens += band.tokens
                if not first:
                    head = band.peek()
                    first = head.request.priority.name if head is not None else ""
        return requests, tokens, first

    def state(self, name: str) -> _ClassState:
        state = self.classes.get(name)
        if state is None:
            state = self.classes[name] = _ClassState()
        return state


class _Ticket:
    """An admission's place in its model's room until released."""

    __slots__ = ("model", "tokens", "released")

    def __init__(self, model: _Model, tokens: int):
        self.model = model
        self.tokens = tokens
        self.released = False
        model.pending += 1
        model.pending_tokens += tokens


class FlowQueue(TaskHost):
    """The gateway's :class:`~.interfaces.FlowControl`. ``await nursery.start(queue.run)`` before the first request:
    the per-model dispatchers run in that task's nursery (a request that must wait raises RuntimeError before)."""

    not_running = "FlowQueue.run() is not running: start it in the gateway's nursery first"

    def __init__(self, settings: FlowSettings, room: Room, metrics: FlowMetrics | None = None):
        self.settings = settings
        self.room = room
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
        if (not model.waiting or not model.waits_at(priority.rank)) and self._has_room(model, priority, cost):
            # The fast path: no await, no clock unless a backlog is being measured.
            if model.waiting:
                model.drain.dispatched(cost, trio.current_time())
            self.metrics.admitted.labels(model.name, priority.name).inc()
            self.metrics.wait.labels(model.name, priority.name).observe(0.0)
            return Admitted(0.0, _Ticket(model, cost))
        return await self._wait(model, request)

    def entered(self, model: str) -> int:
        """The requests for ``model`` that have entered this queue (a counter; it restarts if the model is
        forgotten, beyond :data:`MAX_MODELS`)."""
        found = self._models.get(model)
        return found.entered if found is not None else 0

    def _has_room(self, model: _Model, priority: PriorityClass, cost: int) -> bool:
        """Room for one more request of ``cost`` tokens, besides those admitted and not yet released."""
        return self.room.free(model.name, priority) - model.pending > 0 and \
            self.room.fits(model.name, priority, model.pending_tokens + cost)

    def _new_model(self, name: str) -> _Model:
        if len(self._models) >= MAX_MODELS:  # the data plane names served models only; still, never grow unbounded
            self._models = {n: m for n, m in self._models.items() if m.waiting or m.pending or m.dispatching}
        model = self._models[name] = _Model(name, self._ranks)
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
        if model.waiting:
            model.kick.set()

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
            for _, band in model.bands:
                for waiter in band:  # oldest first: stop once each class waiting in the band was seen
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

    async def _wait(self, model: _Model, request: FlowRequest) -> Admitted | Shed:
        if not self.running:
            raise RuntimeError(self.not_running)
        now = trio.current_time()
        priority = request.priority
        position, tokens_ahead, ahead_class = model.ahead(priority.rank, request)
        explain = (position, tokens_ahead, ahead_class)
        remaining = request.deadline - now
        if remaining <= 0:
            return self._shed(model, request, EXPIRED, 0.0, "its deadline had passed when it arrived", explain)
        rate = model.drain.current(now)
        if rate is not None and tokens_ahead:
            expected = tokens_ahead / rate if rate > 0 else math.inf
            if expected > remaining:
                return self._shed(model, request, UNSERVABLE, 0.0,
                                  f"{tokens_ahead} tokens wait ahead of it for {model.name}, {expected:.1f} s at "
                                  f"the drain rate of {rate:.0f} tokens/s: more than the {remaining:.1f} s its "
                                  f"deadline leaves", explain)
        if self._overflows(model, request):
            return self._shed(model, request, OVERFLOW, 0.0, self._full(model), explain)
        waiter = _Waiter(request, now, *explain)
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
            waiter.outcome = self._shed(model, request, EXPIRED, now - waiter.since,
                                        f"no room for it on {model.name} within its {priority.name} deadline",
                                        explain)
        return waiter.outcome

    def _overflows(self, model: _Model, request: FlowRequest) -> bool:
        """Shed the newest waiters of the lowest bands below ``request``'s until it fits; True: it does not."""
        limit, token_limit = self.settings.max_queued, self.settings.max_queued_tokens
        while model.waiting + 1 > limit or model.tokens + max(request.cost, 0) > token_limit:
            victim = None
            for rank, band in reversed(model.bands):
                if rank <= request.priority.rank:
                    break
                if len(band):
                    victim = band.newest()
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
        model.band(request.priority.rank).push(waiter)
        model.waiting += 1
        model.tokens += waiter.cost
        self._count(model, request.priority.name, 1, waiter.cost)
        model.drain.backlog(True, now)
        if not model.dispatching:
            model.dispatching = True
            self.spawn(self._dispatch, model)
        else:
            model.kick.set()

    def _dequeue(self, model: _Model, waiter: _Waiter, now: float, *, dispatched: bool = False) -> None:
        request = waiter.request
        if not dispatched:  # the dispatcher has popped it already
            model.band(request.priority.rank).remove(waiter)
        model.waiting -= 1
        model.tokens -= waiter.cost
        self._count(model, request.priority.name, -1, -waiter.cost)
        if dispatched:
            model.drain.dispatched(waiter.cost, now)
        if not model.waiting:
            model.drain.backlog(False, now)

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

    def _retry_after(self, model: _Model, priority: PriorityClass, now: float) -> int:
        low, high = self.settings.retry_after_min, self.settings.retry_after_max
        rate = model.drain.current(now)
        if rate is None:
            return low
        tokens = model.ahead(priority.rank)[1]
        seconds = math.ceil(tokens / rate) if rate > 0 else high
        return max(low, min(high, seconds))

    # The dispatcher.

    async def _dispatch(self, model: _Model) -> None:
        try:
            while True:
                model.kick = trio.Event()
                try:
                    self._admit_ready(model)
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
        for _, band in model.bands:
            while (waiter := band.peek()) is not None:
                priority = waiter.request.priority
                if not self._has_room(model, priority, waiter.cost):
                    return
                band.pop()
                self._dequeue(model, waiter, now, dispatched=True)
                waited = now - waiter.since
                waiter.outcome = Admitted(waited, _Ticket(model, waiter.cost), waiter.position, waiter.tokens_ahead,
                                          waiter.ahead_class)
                waiter.event.set()
                self.metrics.admitted.labels(model.name, priority.name).inc()
                self.metrics.wait.labels(model.name, priority.name).observe(waited)
        rate = model.drain.rate
        if rate is not None:
            self.metrics.drain_rate.labels(model.name).set(rate)

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
