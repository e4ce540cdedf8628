"""The room of each model (:class:`~llmgw.flow.interfaces.Room`): what its replicas can still take, learnt from
their engines, less what every gateway has in flight there, split among the gateways that have requests waiting.

- Each replica's capacity (requests in flight) is learnt from its engine's scraped gauges
  (:mod:`llmgw.flow.capacity`); the room asks the router's scraper to scrape every model's engines at least every
  ``scrape_interval`` (``Router.engine_metrics_demand``) and learns from each scrape as it lands.
- A model's room is the sum over its routable replicas of ``capacity - inflight`` (``inflight``: this gateway's
  routed requests and the other gateways' latest, ``Replica.inflight``); a class fills at most its ``max_fill``
  of the summed capacity and, below 1.0, of each replica's seats (its engine's sequence slots, learnt with the
  capacity), so that an arrival of a class above finds a free slot in the engine rather than its queue. A
  replica whose capacity is still unknown is not full: the model's room is then :data:`UNBOUNDED` (nothing is
  held before an engine has said it is full), except while requests for the model are held at a gateway: then
  it takes them in a ramp (:mod:`.ramp`: a few in flight, doubling on each scrape while its KV cache has room,
  whatever capacity is learnt meanwhile), so that a replica appearing under a held burst (from zero, after an
  outage or a restart) gets the oldest first, not all at once.
- The room is counted in KV tokens too: a replica's KV capacity is its engine's scraped cache config (blocks x
  block size), the tokens held there the requests in flight will hold at most (their prompt estimate, this
  gateway's and the others', scaled by how many tokens the engines counted per estimated one in the answers'
  usage, :class:`~llmgw.router.prompt_ratio.PromptTokenRatio`; and their output allowances, what of their
  ``max_tokens`` the model's answers were learnt to hold, :class:`~llmgw.router.output_allowance.OutputAllowance`:
  :meth:`EngineRoom.held_tokens`; an allowance learnt too low is caught by the engine's own KV usage, which cuts
  the replica's capacity at ``kv_high``: :mod:`llmgw.flow.capacity`). A class may dispatch a request only if the
  model's replicas keep the tokens within its ``max_fill`` of their KV capacity (:meth:`EngineRoom.fits`): three
  batch requests that fill the cache leave no room for a fourth, while an interactive one still fits; the request
  asking counts likewise: its prompt estimate scaled by the same ratio, its output at the learnt allowance. Before
  an engine has told its capacity, the tokens hold nothing back. The other gateways' requests count with their
  prompts (in their reports) and, on a replica where this gateway has none, their own mean output per request
  (the output in flight their reports carry, ``f``), else this gateway's mean.
- Shared: every gateway reports how many requests it holds per model with its load (llmgw/cluster/load.py); when
  others hold some too, this gateway may have in flight its quota of the capacity and of the KV tokens, in
  proportion to its demand (requests in flight and held) among every gateway's (:meth:`EngineRoom.demand_share`:
  a quota, not a part of what is free now, so that dispatching one request after another cannot take it all
  before the next report); each peer's count taken at most ``FlowSettings.max_queued`` (a forged report cannot
  claim it all).

The cluster's load sharing is reached through :class:`SharedQueues` (the gateway passes it in): the flow layer
does not import the cluster layer.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any, Callable, Protocol

import trio

from ..engines.probe import EngineLoad
from ..router.decode_cost import DEFAULT_OUTPUT_TOKENS
from ..router.prompt_ratio import PromptTokenRatio
from ..router.replica import Replica, ReplicaState
from ..router.router import EngineMetricsDemand
from .capacity import UNBOUNDED, CapacityRule, ReplicaCapacity
from .model import FlowSettings, PriorityClass
from .ramp import START as RAMP_START, Ramp

if TYPE_CHECKING:
    from ..router.router import Router
    from .room_metrics import RoomMetrics

log = logging.getLogger(__name__)

POLL = 0.05  # changed() returns after this long at the latest
UP, UNKNOWN = ReplicaState.UP, ReplicaState.UNKNOWN


def kv_capacity(replica: Replica) -> int | None:
    """The tokens ``replica``'s engine's KV cache holds, from its last scrape; None while unknown."""
    return cache_tokens(replica.engine_load)


def cache_tokens(load: EngineLoad | None) -> int | None:
    """The tokens an engine's KV cache holds, from ``load`` (a scrape); None when it does not say."""
    if load is None or not load.num_blocks or not load.block_size:
        return None
    return load.num_blocks * load.block_size


class SharedQueues(Protocol):
    """What the room needs of the cluster's load sharing (llmgw.cluster.load.LoadSharing)."""

    def count_queued(self, source: Callable[[], dict[str, int]], max_queued: int) -> None: ...

    def peer_queued(self, model: str) -> list[int]: ...

    def peer_output(self, model: str) -> int | None: ...

    def watch(self, listener: Callable[[], None]) -> None: ...


class EngineRoom:
    def __init__(self, router: Router, sharing: SharedQueues | None = None, settings: FlowSettings | None = None,
                 rule: CapacityRule | None = None, scrape_interval: float = 0.25, scrape_timeout: float = 1.0,
                 metrics: RoomMetrics | None = None, clock: Callable[[], float] = time.monotonic):
        """``scrape_interval``/``scrape_timeout``: how often every model's engines are scraped (seconds), each
        scrape's deadline. ``sharing``: the cluster's load sharing (None: a gateway alone)."""
        self.router = router
        self.sharing = sharing
        self.settings = settings or FlowSettings()
        self.rule = rule or CapacityRule()
        self.scrape_interval = scrape_interval
        self.metrics = metrics
        self.clock = clock
        self._learnt: dict[Replica, ReplicaCapacity] = {}  # a replica's entry goes when it leaves the table
        self._ramps: dict[Replica, Ramp] = {}  # replicas of unknown capacity taking a held burst, likewise
        self._events: dict[str, trio.Event] = {}  # only while someone waits in changed()
        self._waiters: dict[str, int] = {}
        self._queued: Callable[[str], int] = lambda model: 0
        router.engine_metrics_demand = EngineMetricsDemand(scrape_interval, scrape_timeout)
        router.engine_load_listeners.append(self.scraped)
        router.replicas.watch_members(self._members_changed)
        if sharing is not None:
            sharing.count_queued(self.held, self.settings.max_queued)
            sharing.watch(self.wake_all)
        if metrics is not None:
            metrics.track(self)

    def _members_changed(self, replica: Replica) -> None:
        if replica not in self.router.replicas:
            self._learnt.pop(replica, None)
            if (ramp := self._ramps.get(replica)) is not None:
                self._end_ramp(replica, ramp, "it left routing")
        self.wake(replica.model)

    def count_queued(self, queued: Callable[[str], int]) -> None:
        """``queued(model)``: the requests this gateway's queue holds for ``model`` (all classes)."""
        self._queued = queued

    # -- Room ----------------------------------------------------------------------------------------------------

    def free(self, model: str, priority: PriorityClass) -> int:
        return self.scan(model, priority, 0)[0]

    def fits(self, model: str, priority: PriorityClass, tokens: int, output: int = 0) -> bool:
        return self.scan(model, priority, tokens, output)[1]

    def admits(self, model: str, priority: PriorityClass, pending: int, tokens: int, output: int = 0) -> bool:
        free, fits = self.scan(model, priority, tokens, output)
        return free - pending > 0 and fits

    def scan(self, model: str, priority: PriorityClass, tokens: int, output: int = 0) -> tuple[int, bool]:
        """:meth:`free` and :meth:`fits` in one pass over the replicas (the queue's path for every request: kept
        lean). Requests: each replica's learnt capacity less its requests in flight, the class filling at most its
        ``max_fill`` of the summed capacity and, below 1.0, of each replica's seats (so that arrivals of the
        classes above find a free sequence slot in the engine, not a queue). Tokens: summed over the replicas,
        each filled at most to the class's share of its KV cache; a request larger than one replica's share needs
        that much free (it would wait for ever otherwise). Not on one replica: the router, not the room, places
        the request, and a room that waited for one replica to have it all held back more than it saved
        (docs/overload.md, "Measured"). When other gateways hold requests for the model too, this gateway's part of
        both is its quota (:meth:`demand_share`)."""
        route = self.router.models.get(model)
        if route is None:
            return 0, True
        fill = min(1.0, max(0.0, priority.max_fill))
        seated = fill < 1.0  # a class that may fill it all is bounded by the capacity alone
        capacity = free = seat_free = mine = theirs = 0
        unbounded = False
        kv_room = kv_largest = kv_filled = kv_mine = output_inflight = 0
        kv_known = True
        unsized: list[tuple[Replica, int]] = []  # replicas with only the others' requests: their output comes last
        ratio = route.prompt_ratio
        learnt = self._learnt
        for replica in route.replicas:
            state = replica.state
            if state is not UP and state is not UNKNOWN:  # ReplicaState.routable, without its enum lookups
                continue
            local, peer = replica.local_inflight, replica.peer_inflight
            mine += local
            theirs += peer
            if kv_known:
                kv = kv_capacity(replica)
                if kv is None:
                    kv_known = False
                else:
                    share = math.floor(kv * fill)
                    kv_largest = max(kv_largest, share)
                    kv_filled += share
                    output_inflight += replica.local_inflight_output_tokens
                    kv_mine += ratio.tokens(replica.local_inflight_tokens) + replica.local_inflight_output_tokens
                    if local == 0 and peer:
                        unsized.append((replica, share))
                    else:
                        kv_room += max(0, share - self.held_tokens(replica, ratio))
            known = learnt.get(replica)
            ramp = self._ramp_limit(replica, known) if self._ramps or known is None or known.capacity is None \
                else None
            if ramp is not None:
                limit, known = ramp, None  # a held burst's pace (:mod:`.ramp`), not its seats
            elif known is None or known.capacity is None:
                unbounded = True
                continue
            else:
                limit = int(known.capacity)
            capacity += limit
            left = limit - local - peer
            if left > 0:
                free += left
            if seated and known is not None and known.seats is not None:
                left = min(left, max(1, math.floor(known.seats * fill)) - local - peer)
            if left > 0:
                seat_free += left
        if unsized:  # the others' output at their mean per request on the model, else at this gateway's
            per_request = self.peer_mean_output(model, theirs)
            if per_request is None:
                per_request = output_inflight / mine if mine else DEFAULT_OUTPUT_TOKENS
            for replica, share in unsized:
                kv_room += max(0, share - self.held_tokens(replica, ratio, per_request))
        quota = self.demand_share(model, mine, theirs) if self.sharing is not None else None
        # The queue's estimate (prompt and most output, not yet routed) in the engine's count: the prompt part
        # scaled by the ratio, the output (max_tokens, already in the engine's tokens) as the model's answers were
        # learnt to hold it (route.output_allowance). Scaling the whole by the prompt ratio over-counted a batch
        # request's long output several times (docs/overload.md, "Measured").
        output = min(max(output, 0), tokens)
        need = min(ratio.tokens(tokens - output) + route.output_allowance.tokens(output), kv_largest)
        fits = not kv_known or (need <= kv_room and (
            quota is None or mine == 0 or need <= kv_filled * quota[0] // quota[1] - kv_mine))
        if unbounded:
            return UNBOUNDED, fits
        filled = max(1, math.floor(capacity * fill)) if capacity else 0  # what the class may fill: one at least
        free = min(max(0, free - (capacity - filled)), seat_free)
        if free == 0 or quota is None:
            return free, fits
        allowed = filled * quota[0] // quota[1] - mine
        if allowed <= 0:
            return (1 if mine == 0 else 0), fits
        return min(free, allowed), fits

    @staticmethod
    def held_tokens(replica: Replica, ratio: PromptTokenRatio, per_request: float = DEFAULT_OUTPUT_TOKENS) -> int:
        """The KV tokens the requests in flight on ``replica`` will hold at most: their prompt estimates (this
        gateway's and the others') in the engine's count (``ratio``: the model's), and this gateway's output
        estimates; the other gateways' output is taken at this gateway's mean per request there (their reports
        carry prompt tokens only), or at ``per_request`` where it has none there (:meth:`scan` passes its mean
        over the model's replicas)."""
        output = replica.local_inflight_output_tokens
        if replica.peer_inflight:
            local = replica.local_inflight
            output += replica.peer_inflight * output // local if local else int(replica.peer_inflight * per_request)
        return ratio.tokens(replica.inflight_tokens) + output

    def peer_mean_output(self, model: str, theirs: int) -> float | None:
        """The output allowance per request the other gateways have in flight on ``model`` (``theirs`` requests),
        from their load reports; None when one of them does not report it or they have none in flight."""
        if self.sharing is None or not theirs:
            return None
        output = self.sharing.peer_output(model)
        return None if output is None else output / theirs

    def demand_share(self, model: str, mine: int, theirs: int) -> tuple[int, int] | None:
        """When other gateways hold requests for ``model`` too: this gateway's demand (its requests in flight,
        ``mine``, and those it holds) and every gateway's (``theirs`` in flight, and those they hold), whose ratio
        is its quota of what a class may fill, in requests and in KV tokens. A quota, not a part of what is free
        now, so that dispatching one request after another cannot take the others' part before their next report;
        at least 1 request while it has none in flight (nobody starves). None while no other gateway holds any:
        then a quota would hold back nothing the engines have room for. Each peer's count is taken at most
        ``max_queued`` (a forged report cannot claim it all)."""
        cap = self.settings.max_queued
        held_by_peers = sum(min(n, cap) for n in self.sharing.peer_queued(model)) if self.sharing else 0
        if held_by_peers == 0:
            return None
        demand = mine + max(1, min(self._queued(model), cap))  # a request arriving to an empty queue counts as one
        return demand, demand + theirs + held_by_peers

    async def changed(self, model: str) -> None:
        event = self._events.get(model)
        if event is None:
            event = self._events[model] = trio.Event()
        self._waiters[model] = self._waiters.get(model, 0) + 1
        try:
            with trio.move_on_after(POLL):
                await event.wait()
        finally:
            left = self._waiters.pop(model) - 1
            if left:
                self._waiters[model] = left
            elif self._events.get(model) is event:  # the last waiter of an event nobody set: forget it
                del self._events[model]

    def wake(self, model: str) -> None:
        event = self._events.pop(model, None)
        if event is not None:
            event.set()

    def wake_all(self) -> None:
        events, self._events = self._events, {}
        for event in events.values():
            event.set()

    def saturation(self, model: str) -> float:
        route = self.router.models.get(model)
        if route is None:
            return 0.0
        inflight = capacity = 0
        unknown = 0.0
        for replica in route.replicas:
            limit = self.capacity(replica)
            if not replica.routable:
                continue
            if limit is None:
                unknown = max(unknown, self.replica_saturation(replica))
            else:
                inflight += replica.inflight
                capacity += limit
        return max(inflight / capacity if capacity else 0.0, unknown)

    # -- learning ------------------------------------------------------------------------------------------------

    def seats(self, replica: Replica) -> int | None:
        """The sequences ``replica``'s engine runs at once, None while unknown."""
        learnt = self._learnt.get(replica)
        return None if learnt is None else learnt.seats

    def capacity(self, replica: Replica) -> int | None:
        """The requests in flight ``replica`` takes, None while unknown."""
        learnt = self._learnt.get(replica)
        return None if learnt is None else learnt.limit()

    def replica_saturation(self, replica: Replica) -> float:
        """Its in-flight requests over its capacity; while that is unknown, its engine's KV usage over
        ``kv_high`` when the last scrape is fresh (3 intervals), else 0."""
        limit = self.capacity(replica)
        if limit is not None:
            return replica.inflight / limit
        load = replica.engine_load
        if load is None or load.kv_usage is None or self.clock() - load.at > 3 * self.scrape_interval:
            return 0.0
        return load.kv_usage / self.rule.kv_high

    def scraped(self, replica: Replica) -> None:
        """The scraper has a new ``engine_load`` for ``replica``: learn from it, wake the model's waiters."""
        load = replica.engine_load
        if load is None:
            return
        learnt = self._learnt.get(replica)
        if learnt is None:
            learnt = self._learnt[replica] = ReplicaCapacity()
        before, seats_before = learnt.capacity, learnt.seats
        change = learnt.observe(load, replica.inflight, self.demand(replica.model), self.rule, self._busy_share(),
                                self.needed_tokens(replica, load))
        if learnt.queue is not None and self.metrics is not None:
            self.metrics.engine_queued(replica.model, learnt.queue)
        if change is not None:
            if before is None:
                log.info("flow control: replica %s of model %s is full at %d requests in flight (its engine: %g "
                         "running, %g waiting, KV usage %s); requests beyond its learnt capacity now wait at the "
                         "gateway (llmgw_flow_replica_capacity)", replica.name, replica.model, replica.inflight,
                         load.running, load.waiting, "unknown" if load.kv_usage is None else f"{load.kv_usage:.2f}")
            if self.metrics is not None:
                self.metrics.capacity_changed(replica.model, change)
        if (ramp := self._ramps.get(replica)) is not None:
            self._ramp_scraped(replica, ramp, load, learnt)
        if learnt.seats is not None and learnt.seats != seats_before:
            log.info("flow control: replica %s of model %s runs %d sequences at once (its engine queued at that with "
                     "KV usage %s); classes below max_fill 1.0 now keep their share of its seats free "
                     "(llmgw_flow_replica_seats)", replica.name, replica.model, learnt.seats,
                     "unknown" if load.kv_usage is None else f"{load.kv_usage:.2f}")
        self.wake(replica.model)

    def needed_tokens(self, replica: Replica, load: EngineLoad) -> float | None:
        """The KV tokens ``replica``'s engine must still find for the requests in flight there (every gateway's):
        what they will hold at most (:meth:`held_tokens`) less what its cache holds now, what tells a queue for
        blocks from one for the step's budget (:func:`~llmgw.flow.capacity.queue_kind`). None when it cannot be
        told: its KV capacity or usage unknown, or more requests in the engine than the gateways know in flight
        there (a peer's report not in yet, or requests from elsewhere: of sizes nobody here knows)."""
        capacity = cache_tokens(load)
        route = self.router.models.get(replica.model)
        inflight = replica.inflight
        if capacity is None or load.kv_usage is None or route is None or load.requests > inflight:
            return None
        return max(0.0, self.held_tokens(replica, route.prompt_ratio) - load.kv_usage * capacity)

    # -- a held burst's slow start (llmgw/flow/ramp.py) -----------------------------------------------------------

    def ramping(self, model: str) -> bool:
        return any(replica.model == model for replica in self._ramps)

    def ramp(self, replica: Replica) -> int | None:
        """The requests in flight ``replica`` may take in its ramp through a held burst, None when in none."""
        ramp = self._ramps.get(replica)
        return None if ramp is None else ramp.limit

    def _ramp_limit(self, replica: Replica, known: ReplicaCapacity | None) -> int | None:
        """While requests for its model are held: the ramp's limit of a replica in one, or of one whose capacity
        is unknown (one begins), at least its learnt capacity. Else None (the room is its capacity, or unbounded
        while unknown), and a ramp it was in ends."""
        ramp = self._ramps.get(replica)
        if ramp is None and known is not None and known.capacity is not None:
            return None
        if not self.demand(replica.model):
            if ramp is not None:
                self._end_ramp(replica, ramp, "nothing is held any more")
            return None
        if ramp is None:
            ramp = self._start_ramp(replica)
        learnt = known.limit() if known is not None else None
        return ramp.limit if learnt is None else max(ramp.limit, learnt)

    def _start_ramp(self, replica: Replica) -> Ramp:
        # What it already carries without its engine queueing (else its capacity would be known) it has proven.
        cap = self.settings.max_queued
        held = self._queued(replica.model) + sum(
            min(n, cap) for n in (self.sharing.peer_queued(replica.model) if self.sharing else ()))
        ramp = self._ramps[replica] = Ramp(max(RAMP_START, replica.inflight), self.clock(), held)
        log.info("flow control: replica %s of model %s has room while %d requests are held for the model (this "
                 "gateway's and the others') and its capacity is unknown: it takes them oldest first, %d in flight "
                 "at first, doubling on each scrape while its KV cache has room (llmgw_flow_replica_ramp)",
                 replica.name,
                 replica.model, held, ramp.limit)
        if self.metrics is not None:
            self.metrics.ramp_started(replica.model, held)
        return ramp

    def _ramp_scraped(self, replica: Replica, ramp: Ramp, load: EngineLoad, learnt: ReplicaCapacity) -> None:
        if not self.demand(replica.model):
            self._end_ramp(replica, ramp, "nothing is held any more")
        else:
            ramp.observe(load, replica.inflight, self.rule, self._busy_share())

    def _end_ramp(self, replica: Replica, ramp: Ramp, why: str) -> None:
        del self._ramps[replica]
        seconds = max(0.0, self.clock() - ramp.started)
        capacity = self.capacity(replica)
        log.info("flow control: replica %s of model %s ends its ramp through a held burst after %.2f s (%s): %d "
                 "requests were held when it began; it reached %d in flight after %d doublings; its capacity %s",
                 replica.name, replica.model, seconds, why, ramp.held, ramp.limit, ramp.doublings,
                 "is still unknown" if capacity is None else f"was learnt at {capacity}")
        if self.metrics is not None:
            self.metrics.ramp_ended(replica.model, seconds)

    def _busy_share(self) -> float:
        """The share of a replica's room in flight from which it counts as full: the lowest class's ``max_fill``,
        since a class fills no more."""
        return min((c.max_fill for c in self.settings.classes), default=1.0)

    def demand(self, model: str) -> bool:
        """Requests for ``model`` wait at a gateway (this one or another)."""
        if self._queued(model) > 0:
            return True
        return self.sharing is not None and bool(self.sharing.peer_queued(model))

    def held(self) -> dict[str, int]:
        """The requests this gateway holds per model (what its load report says)."""
        return {model: n for model in list(self.router.models) if (n := self._queued(model)) > 0}

    def describe(self, model: str) -> dict[str, Any]:
        """The model's room for /admin/explain: per replica its learnt capacity and in-flight requests, its KV
        capacity and the tokens in flight there (tokens)."""
        route = self.router.models.get(model)
        replicas = [] if route is None else [
            {"name": replica.name, "capacity": self.capacity(replica), "inflight": replica.inflight,
             "kv_capacity_tokens": kv_capacity(replica), "held_tokens": self.held_tokens(replica, route.prompt_ratio),
             "saturation": round(self.replica_saturation(replica), 3), "cuts": learnt.cuts if learnt else 0,
             "raises": learnt.raises if learnt else 0, "seats": learnt.seats if learnt else None,
             "ramp": self.ramp(replica)}
            for replica in route.replicas for learnt in [self._learnt.get(replica)]]
        peers = [] if self.sharing is None else self.sharing.peer_queued(model)
        return {"replicas": replicas, "held": self._queued(model), "peers_held": peers,
                "saturation": round(self.saturation(model), 3)}


