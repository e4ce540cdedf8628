"""The :class:`~.interfaces.SignalSource` of a gateway: one model's demand and state from what this process holds.

- queued: the requests (and their tokens) this gateway's flow queue holds for the model, plus what the other
  gateways' load reports say they hold (``q``, llmgw/cluster/load.py);
- in flight: every replica's ``inflight`` (this gateway's exact count plus the peers' latest reports);
- KV usage: the mean of the ready replicas' last scrape (the room's, llmgw/flow/room.py);
- busy: the ready replicas' requests in flight over what each takes (``seats_of``: its engine's seats, or the flow
  room's learnt capacity when lower), each at most 1, summed: the replicas' worth the load keeps busy, before any
  queue (the scaler's utilisation target);
- the drain rate: the replicas' ``served`` counters, in all and per ready replica-second; the arrivals: the
  requests entering every gateway's flow queue (this one's counter, and each other's from its load reports, ``f``
  in llmgw/cluster/load.py: :class:`PeerArrivals`); a gateway of a version before, whose reports lack them, is
  counted as if it saw as many as the mean of those that report (a balancer spreading evenly). The drain rate is
  this gateway's own count (the load reports do not carry the others' finished requests), scaled to the cluster
  times the live gateways (a balancer spreading evenly makes this gateway's share one in ``gateways``): left
  unscaled, N gateways would ask for N times the replicas a backlog needs. All are rates over at least
  :data:`MIN_SPAN`, smoothed (a rise faster than a fall: :data:`RISING`);
- TTFT attainment: the share of the cluster's first tokens of the last :data:`TTFT_WINDOW` within the deployment's
  ``ttft_slo``: this gateway's (:class:`FirstTokens`) and the counts the others report;
- the last request: the last reading with anything queued or in flight, or a counter that moved (a fresh source
  counts its start as one, so a new leader does not scale an idle model to zero before ``idle_to_zero`` has
  passed under it).

Local copies only: nothing here waits on Redis or an engine.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

from .model import ModelSignals

if TYPE_CHECKING:
    from ..router.replica import Replica
    from ..router.router import Router

SMOOTHING = 0.3  # the weight of the newest rate in the served and arrival averages when it falls...
# ...and when it rises: a step in demand shows within a span or two (at 0.3 it took four spans, 4 s, before a doubled
# rate asked for its replicas), while a drop is still smoothed slowly (scaling down waits anyway).
RISING = 0.7
MIN_SPAN = 1.0  # seconds a rate is measured over at least: a reading or two of a few requests is noise
TTFT_WINDOW = 60.0  # seconds of first tokens the attainment is the share of
MAX_FIRST_TOKENS = 2048  # first tokens kept per model (the newest): bounded whatever the load
MAX_MODELS = 1024  # models whose first tokens are kept (the config's served models; never unbounded)


class FirstTokens:
    """This gateway's recent first-token latencies per model (the router's ``first_token_listeners`` feed it)."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self._seen: dict[str, deque[tuple[float, float]]] = {}

    def observe(self, model: str, ttft: float) -> None:
        seen = self._seen.get(model)
        if seen is None:
            if len(self._seen) >= MAX_MODELS:
                return
            seen = self._seen[model] = deque(maxlen=MAX_FIRST_TOKENS)
        seen.append((self.clock(), ttft))

    def attainment(self, model: str, slo: float, now: float) -> float | None:
        """The share of the first tokens of the last :data:`TTFT_WINDOW` within ``slo`` seconds; None: none."""
        within, seen = self.counts(model, slo, now)
        return within / seen if seen else None

    def counts(self, model: str, slo: float, now: float) -> tuple[int, int]:
        """Of the first tokens of the last :data:`TTFT_WINDOW`, those within ``slo`` seconds, and all of them (what
        this gateway's load report tells the leader)."""
        seen = self._seen.get(model)
        if not seen:
            return 0, 0
        while seen and seen[0][0] < now - TTFT_WINDOW:
            seen.popleft()
        return sum(1 for _, ttft in seen if ttft <= slo), len(seen)

    def forget(self, keep: set[str]) -> None:
        for model in list(self._seen):
            if model not in keep:
                del self._seen[model]


class PeerFigures(Protocol):
    """What the signals read of another gateway's figures for a model (llmgw.cluster.records.ModelFigures)."""

    @property
    def entered(self) -> int: ...

    @property
    def ttft_within(self) -> int: ...

    @property
    def ttft_seen(self) -> int: ...


class PeerArrivals:
    """The requests that entered the other gateways' queues, per model, as one counter: each peer's counter followed
    from its first report seen (what it counted before is not an arrival now); a counter that fell (that gateway
    restarted) counts from zero; a peer gone is forgotten (bounded by the peers a load sharing keeps)."""

    def __init__(self) -> None:
        self._last: dict[str, dict[str, int]] = {}  # model -> origin -> its counter at the last reading
        self._total: dict[str, int] = {}

    def update(self, model: str, peers: Mapping[str, PeerFigures]) -> int:
        last = self._last.setdefault(model, {})
        total = self._total.get(model, 0)
        for origin, figures in peers.items():
            before = last.get(origin)
            if before is not None:
                total += figures.entered - before if figures.entered >= before else figures.entered
            last[origin] = figures.entered
        for origin in [origin for origin in last if origin not in peers]:
            del last[origin]
        self._total[model] = total
        return total

    def forget(self, keep: set[str]) -> None:
        for model in [model for model in self._last if model not in keep]:
            del self._last[model]
            self._total.pop(model, None)


@dataclass
class _Rate:
    """A counter's rate per second, measured over at least :data:`MIN_SPAN` and smoothed."""

    count: int
    at: float
    rate: float = 0.0

    def update(self, count: int, now: float) -> bool:
        """Fold the reading in (when :data:`MIN_SPAN` has passed); whether the counter moved."""
        moved = count != self.count
        if now - self.at >= MIN_SPAN or (moved and self.rate == 0 and now > self.at):
            # The first requests after a quiet spell show their rate at once: a replica just ready is measured
            # before a backlog's count could ask for more than its arrivals need.
            # A replica that left takes its count with it (a queue forgotten, its): a drop is no negative rate.
            rate = max(0, count - self.count) / (now - self.at)
            weight = RISING if rate > self.rate else SMOOTHING
            self.rate = rate if self.rate == 0 else weight * rate + (1 - weight) * self.rate
            self.count, self.at = count, now
        elif count < self.count:
            self.count = count
        return moved


@dataclass
class _Seen:
    served: _Rate
    entered: _Rate
    at: float  # the last reading
    ready: int  # the replicas ready at it (ready until this reading: they are counted over the span before it)
    ready_seconds: float = 0.0  # ready replicas integrated over time (a counter, as ``served`` is)
    served_at_fold: int = 0
    ready_seconds_at_fold: float = 0.0
    per_replica: float = 0.0  # served per ready replica-second, smoothed
    seats: int | None = None  # the most seats any of the model's replicas was known to have (one profile: the same)
    last_request_at: float | None = None
    worked_since_fold: bool = False  # a reading since the last fold had requests queued or in flight

    def fold_per_replica(self, served: int) -> None:
        """The drain rate of one ready replica since the last fold: the requests finished over the ready
        replica-seconds (not over the replicas ready now: one that just became ready has finished nothing yet).
        A span in which the replicas had nothing to do (nothing queued or in flight at any reading, nothing
        finished) is left out: it says nothing of how fast they drain, and folding it in would take the rate
        towards 0 over a quiet spell, so that the next backlog would look like a need for ``max``."""
        spent = self.ready_seconds - self.ready_seconds_at_fold
        idle = not self.worked_since_fold and served == self.served_at_fold
        self.worked_since_fold = False
        if spent > 0 and served >= self.served_at_fold and not idle:
            rate = (served - self.served_at_fold) / spent
            self.per_replica = rate if self.per_replica == 0 else \
                SMOOTHING * rate + (1 - SMOOTHING) * self.per_replica
        self.served_at_fold, self.ready_seconds_at_fold = served, self.ready_seconds


class GatewaySignals:
    def __init__(self, router: "Router", held: Callable[[str], tuple[int, int]],
                 peer_held: Callable[[str], list[int]] = lambda model: [], *,
                 entered: Callable[[str], int] = lambda model: 0, gateways: Callable[[], int] = lambda: 1,
                 first_tokens: FirstTokens | None = None, slo_of: Callable[[str], float | None] = lambda model: None,
                 peer_figures: Callable[[str], Mapping[str, PeerFigures]] = lambda model: {},
                 seats_of: Callable[["Replica"], int | None] = lambda replica: None):
        """``held(model)``: (requests, tokens) this gateway's flow queue holds; ``peer_held(model)``: what each
        other gateway's latest load report says it holds; ``entered(model)``: the requests that have entered this
        gateway's flow queue (a counter); ``gateways()``: the live gateways, this one included; ``slo_of(model)``:
        the deployment's ``ttft_slo`` (None: no attainment is measured); ``peer_figures(model)``: per other
        gateway (by origin) that reports them, its arrivals and first tokens; ``seats_of(replica)``: the requests in
        flight it takes before it is full (its engine's seats, or fewer; None: not known yet)."""
        self.router = router
        self.held = held
        self.peer_held = peer_held
        self.entered = entered
        self.gateways = gateways
        self.first_tokens = first_tokens
        self.slo_of = slo_of
        self.peer_figures = peer_figures
        self.seats_of = seats_of
        self._peer_arrivals = PeerArrivals()
        self._seen: dict[str, _Seen] = {}

    def signals(self, model: str, now: float) -> ModelSignals:
        route = self.router.models.get(model)
        replicas = list(route.replicas) if route is not None else []
        requests, tokens = self.held(model)
        queued = requests + sum(self.peer_held(model))
        inflight = sum(replica.inflight for replica in replicas)
        served = sum(replica.served for replica in replicas)
        peers = self.peer_figures(model)
        entered = self.entered(model) + self._peer_arrivals.update(model, peers)
        usage = [replica.engine_load.kv_usage for replica in replicas
                 if replica.routable and replica.engine_load is not None and replica.engine_load.kv_usage is not None]
        ready = sum(1 for replica in replicas if replica.routable)
        seen = self._seen.get(model)
        if seen is None:
            seen = self._seen[model] = _Seen(_Rate(served, now), _Rate(entered, now), now, ready, served_at_fold=served,
                                             last_request_at=now)
        elif now > seen.served.at:
            seen.worked_since_fold |= bool(queued or inflight)
            seen.ready_seconds += seen.ready * (now - seen.at)
            seen.at, seen.ready = now, ready
            folded_at = seen.served.at
            if seen.served.update(served, now) | seen.entered.update(entered, now):
                seen.last_request_at = now
            if seen.served.at != folded_at:
                seen.fold_per_replica(served)
        if queued or inflight:
            seen.last_request_at = now
        busy = self._busy(seen, [replica for replica in replicas if replica.routable])
        slo = self.slo_of(model)
        attainment = None
        if slo is not None and self.first_tokens is not None:
            within, first_tokens = self.first_tokens.counts(model, slo, now)
            within += sum(figures.ttft_within for figures in peers.values())
            first_tokens += sum(figures.ttft_seen for figures in peers.values())
            attainment = within / first_tokens if first_tokens else None
        share = max(1, self.gateways())  # this gateway sees one share of the cluster's requests in ``share``
        # Gateways whose reports carry no arrivals (a version before) are taken to see the reporting ones' mean.
        reporting = 1 + len(peers)
        return ModelSignals(model=model, at=now, queued=queued, queued_tokens=tokens, inflight=inflight,
                            arrivals_per_s=seen.entered.rate * max(reporting, share) / reporting,
                            served_per_s=seen.served.rate * share, served_per_replica_s=seen.per_replica * share,
                            kv_usage=sum(usage) / len(usage) if usage else None, busy=busy,
                            ttft_attainment=attainment, last_request_at=seen.last_request_at)

    def _busy(self, seen: _Seen, ready: list["Replica"]) -> float | None:
        """The ready replicas' busy seats, in replicas: each one's requests in flight (every gateway's) over its
        seats, at most 1; None until the seats of one of the model's replicas are known."""
        for replica in ready:
            seats = self.seats_of(replica)
            if seats is not None and seats > 0:
                seen.seats = max(seats, seen.seats or 0)
        if seen.seats is None:
            return None
        return sum(min(1.0, replica.inflight / (self.seats_of(replica) or seen.seats)) for replica in ready)

    def forget(self, keep: set[str]) -> None:
        """Drop what is remembered of models no longer autoscaled (bounded by the config's models)."""
        for model in list(self._seen):
            if model not in keep:
                del self._seen[model]
        self._peer_arrivals.forget(keep)
        if self.first_tokens is not None:
            self.first_tokens.forget(keep)
