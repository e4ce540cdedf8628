"""The router's KV index: which block keys each replica's engine holds, and how many leading blocks of a prompt.

One :class:`KvIndex` per router, fed with :class:`~llmgw.kv.changes.BlockChanges` (the control plane's
:class:`llmgw.wire.KvChanges` have the same fields) by ``apply``, read by the ``kv_index`` tier (``match``).

Layout: one dict ``key -> bitmask of replica slots`` for every confirmed
block, plus per replica the set of its keys (for FULL replacement, RESET and
the size gauges). Matching a prompt walks its keys from block 0 with one dict
lookup per block, AND-ing the candidates' bits; a replica's leading run ends
at the first block it lacks, and the walk stops as soon as no candidate is
left. So a miss costs one lookup, and a 2048-block (32k-token) prompt held
entirely costs 2048 lookups (about 100 µs; ``llmgw/bench/kv_routing.py``).

Per replica a health state:

- ``no_events``: nothing received yet (or the agent's stream was lost:
  :meth:`KvIndex.forget`); the tier routes it as the prefix tree would;
- ``healthy``: a FULL copy or a DELTA arrived;
- ``resetting``: a RESET arrived (engine restart, ``AllBlocksCleared``, a gap
  replay could not fill); ends with the next FULL, the next DELTA storing
  blocks, or after ``reset_window`` seconds, whichever comes first;
- ``suspect``: the engine's reported cached tokens contradicted the index
  too often (:meth:`KvIndex.observe`, the rule in :mod:`llmgw.kv.drift`);
  the replica's owner was asked to resync (the resync listeners), again every
  ``resync_retry`` seconds while no answer came (by :meth:`KvIndex.tick`);
  ends with the next FULL or RESET (the answer), or ``forget``.

Threads: the readers (``state``, ``healthy``, ``summary``, ``describe``,
``drift_summary``, ``predicted_keys``, ``blocks``, ``keys``...) never write:
the Prometheus collector calls ``summary`` and ``drift_summary`` from the
worker thread that renders ``/metrics``, while the Trio thread writes. Only
the Trio thread writes (``apply``, ``observe``, ``forget``, ``remove``,
``predict``, ``settle``, ``unpredict``, ``match``, which drops expired
predictions, and ``tick``), and only a writer calls the resync listeners. So
what changes with time alone is *reported* by the readers (a ``resetting``
replica whose window passed reads as ``healthy``) and *done* by
:meth:`KvIndex.tick`: it folds that ``resetting`` into ``healthy``, asks
again for the resyncs of suspect replicas whose retry is due, and expires
predictions. :meth:`KvIndex.maintain` runs it every 0.25 s in the gateway's
root nursery; without it (a unit test) a retry happens when ``tick`` is
called.

*Predicted* entries (:meth:`KvIndex.predict`) record a request just routed
(a :class:`Prediction`), so that a burst of requests sharing a new prefix
co-locates before the engine's events arrive. They live apart from the
confirmed entries, never change them, and count in :meth:`KvIndex.match` (not
in :meth:`KvIndex.blocks` nor the gauges). Each lasts ``ttl`` seconds (default
2) unless dropped earlier (:meth:`KvIndex.unpredict`: the attempt failed).

A removal the engine reports for a predicted block is ambiguous while the
request is *unsettled*: the engine may have evicted the block before it
admitted the request (it recomputes and stores it again, and that store is
still on its way), or after (the cache is gone). So a removal drops a
replica's predicted entry only when no unsettled prediction holds it. A
prediction settles when a store of one of its blocks arrives (its prefill's
events are in: later removals are newer), or when the response showed every
predicted block served from cache (:meth:`KvIndex.settle`: nothing of it will
be stored again). Without that, a request routed right after another one
whose eviction and re-store were in flight was predicted fewer blocks than
the engine held (seen with vLLM, back to back requests).

A RESET, a ``forget`` or a ``remove`` drops that replica's predicted entries
with its confirmed ones (its engine holds none of them any more).

Prediction listeners (:meth:`KvIndex.add_prediction_listener`) hear every
prediction this process's tiers make, so that other gateway processes can
apply it too (:mod:`llmgw.cluster.learn`). Those processes' predictions come
back through ``predict(..., remote=True)``: they count and end like local
ones, but no listener hears them (no echo), and they never create a replica
the index does not know.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from enum import Enum
from typing import Any, Protocol

import trio

from . import drift as drift_rule
from .changes import ChangesFields, KvChangeKind
from .drift import DriftPolicy

log = logging.getLogger(__name__)

DEFAULT_RESET_WINDOW = 5.0
DEFAULT_PREDICTED_TTL = 2.0
DEFAULT_DRIFT_POLICY = DriftPolicy()


class IndexState(str, Enum):
    NO_EVENTS = "no_events"
    HEALTHY = "healthy"
    RESETTING = "resetting"
    SUSPECT = "suspect"


ResyncListener = Callable[[str, str, str], None]  # (replica id, mode: "full" or "reset", reason)
PredictionListener = Callable[[str, Sequence[int], float], None]  # (replica id, block keys, ttl in seconds)


class _Replica:
    __slots__ = ("name", "bit", "keys", "block_size", "state", "reason", "resetting_until", "changes", "resets",
                 "updated_at", "epoch", "drift", "over_times", "suspect_reason", "resyncs", "last_resync",
                 "resync_retry_at", "resync_every", "predicted", "unsettled")

    def __init__(self, name: str, bit: int):
        self.name = name
        self.bit = bit
        self.keys: set[int] = set()
        self.block_size = 0
        self.state = IndexState.NO_EVENTS
        self.reason = ""
        self.resetting_until = 0.0
        self.changes = 0  # block changes applied (stored + removed + FULL sizes)
        self.resets = 0
        self.updated_at = 0.0
        self.epoch = 0  # bumped by every FULL, RESET and forget: drift seen before it is about an older index
        self.drift = {drift_rule.MATCH: 0, drift_rule.OVER: 0, drift_rule.UNDER: 0}
        self.over_times: deque[float] = deque()  # when recent `over` drifts were seen (within the policy's window)
        self.suspect_reason = ""
        self.resyncs = {mode: 0 for mode in drift_rule.RESYNC_MODES}  # resync requests, by mode
        self.last_resync: tuple[float, str] | None = None  # (when, mode) of the last resync asked for
        self.resync_retry_at = 0.0
        self.resync_every = drift_rule.DEFAULT_RESYNC_RETRY
        self.predicted: dict[int, list[int]] = {}  # key -> [live predictions holding it, unsettled ones]
        self.unsettled: dict[int, Prediction] = {}  # serial -> live predictions not settled yet


HOLDS, UNSETTLED = 0, 1  # a predicted entry: [live predictions holding the key, how many of them unsettled]


class Prediction:
    """A request routed to a replica, its block keys counted as held there until it expires or is dropped.

    Returned by :meth:`KvIndex.predict`; the tier passes it back to :meth:`KvIndex.settle` and
    :meth:`KvIndex.unpredict`.
    """

    __slots__ = ("replica", "serial", "expiry", "keys", "entries", "settled", "live")

    def __init__(self, replica: _Replica, serial: int, expiry: float, keys: Sequence[int],
                 entries: list[tuple[int, list[int]]]):
        self.replica = replica
        self.serial = serial
        self.expiry = expiry
        self.keys = frozenset(keys)
        self.entries = entries  # (key, the entry it counted in)
        self.settled = False
        self.live = True

    def __lt__(self, other: "Prediction") -> bool:  # heap order after the expiry
        return self.serial < other.serial


class KvIndexView(Protocol):
    """What a routing tier may do with the router's KV index: read it, and record what it routed (predicted
    entries, drift observations). The engines' confirmed blocks (:meth:`KvIndex.apply`, ``forget``,
    ``remove``) are written only by their owner (the control plane, or a gateway's follower of the shared
    state), never by a tier."""

    def replicas(self) -> list[str]: ...
    def state(self, replica_id: str) -> IndexState: ...
    def healthy(self, replica_id: str) -> bool: ...
    def block_size(self, replica_id: str) -> int | None: ...
    def blocks(self, replica_id: str) -> int: ...
    def describe(self, replica_id: str) -> dict[str, Any]: ...
    def summary(self) -> dict[str, tuple[int, str]]: ...
    def drift_summary(self) -> dict[str, dict[str, int]]: ...
    def epoch(self, replica_id: str) -> int: ...
    def match(self, keys: Sequence[int], replica_ids: Iterable[str], *, predicted: bool = True) -> dict[str, int]: ...
    def match_detail(self, keys: Sequence[int], replica_ids: Iterable[str], *,
                     predicted: bool = True) -> dict[str, tuple[int, int]]: ...
    def predict(self, replica_id: str, keys: Sequence[int], ttl: float | None = None) -> Prediction | None: ...
    def settle(self, prediction: Prediction | None) -> None: ...
    def unpredict(self, prediction: Prediction | None) -> None: ...
    def observe(self, replica_id: str, result: str, *, epoch: int,
                policy: DriftPolicy = DEFAULT_DRIFT_POLICY) -> str | None: ...


class KvIndex:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic, reset_window: float = DEFAULT_RESET_WINDOW,
                 predicted_ttl: float = DEFAULT_PREDICTED_TTL):
        self.clock = clock
        self.reset_window = reset_window
        self.predicted_ttl = predicted_ttl
        self._holders: dict[int, int] = {}  # confirmed: key -> bitmask of replica slots
        self._replicas: dict[str, _Replica] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._pred_mask: dict[int, int] = {}  # predicted: key -> bitmask of the replica slots predicting it
        self._pred_heap: list[tuple[float, Prediction]] = []  # live predictions by expiry
        self._pred_serial = itertools.count()
        self._resync_listeners: list[ResyncListener] = []
        self._prediction_listeners: list[PredictionListener] = []

    # -- replicas -------------------------------------------------------------------------------------------------

    def _replica(self, replica_id: str) -> _Replica:
        replica = self._replicas.get(replica_id)
        if replica is None:
            slot = heapq.heappop(self._free_slots) if self._free_slots else self._next_slot
            if slot == self._next_slot:
                self._next_slot += 1
            replica = self._replicas[replica_id] = _Replica(replica_id, 1 << slot)
        return replica

    def replicas(self) -> list[str]:
        return list(self._replicas)

    def state(self, replica_id: str) -> IndexState:
        """The replica's state now; changes nothing (any thread may read it: the module's docstring)."""
        replica = self._replicas.get(replica_id)
        return IndexState.NO_EVENTS if replica is None else self._state_at(replica, self.clock())

    @staticmethod
    def _state_at(replica: _Replica, now: float) -> IndexState:
        """A RESETTING index whose window has passed is HEALTHY (an empty cache is a known state) even before
        :meth:`tick` stores that."""
        if replica.state is IndexState.RESETTING and now >= replica.resetting_until:
            return IndexState.HEALTHY
        return replica.state

    def healthy(self, replica_id: str) -> bool:
        return self.state(replica_id) is IndexState.HEALTHY

    def block_size(self, replica_id: str) -> int | None:
        replica = self._replicas.get(replica_id)
        return replica.block_size or None if replica is not None else None

    def blocks(self, replica_id: str) -> int:
        replica = self._replicas.get(replica_id)
        return len(replica.keys) if replica is not None else 0

    def holds(self, replica_id: str, key: int) -> bool:
        replica = self._replicas.get(replica_id)
        return replica is not None and key in replica.keys

    def keys(self, replica_id: str) -> set[int]:
        replica = self._replicas.get(replica_id)
        return set(replica.keys) if replica is not None else set()

    def summary(self) -> dict[str, tuple[int, str]]:
        """``{replica: (blocks, state)}`` for the gauges (read from the scrape's worker thread: the replicas are
        copied in one step, so the Trio thread adding one meanwhile does not break the iteration)."""
        now = self.clock()
        return {name: (len(r.keys), self._state_at(r, now).value) for name, r in list(self._replicas.items())}

    def describe(self, replica_id: str) -> dict[str, Any]:
        """What the index knows of one replica, as JSON-able data (for explain and the admin API)."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return {"state": IndexState.NO_EVENTS.value, "blocks": 0, "block_size": None}
        last = replica.last_resync
        return {"state": self.state(replica_id).value, "blocks": len(replica.keys),
                "block_size": replica.block_size or None, "last_reset_reason": replica.reason or None,
                "resets": replica.resets, "changes": replica.changes,
                "drift": {**replica.drift, "recent_over": len(replica.over_times),
                          "suspect_reason": replica.suspect_reason or None, "resyncs": dict(replica.resyncs),
                          "last_resync": last[1] if last else None,
                          "last_resync_ago": round(self.clock() - last[0], 3) if last else None}}

    def drift_summary(self) -> dict[str, dict[str, int]]:
        """``{replica: {mode: resync requests}}`` for the metrics (copied as :meth:`summary` does)."""
        return {name: dict(r.resyncs) for name, r in list(self._replicas.items())}

    def epoch(self, replica_id: str) -> int:
        """Bumped by every FULL, RESET and forget of the replica: tags a decision with the index it was made on."""
        replica = self._replicas.get(replica_id)
        return replica.epoch if replica is not None else 0

    def forget(self, replica_id: str) -> None:
        """The agent's stream for this replica was lost: drop what we knew, back to ``no_events``.

        The agent sends a FULL copy when its stream reconnects.
        """
        replica = self._replicas.get(replica_id)
        if replica is not None:
            self._clear(replica)
            self._drop_predicted(replica)
            self._settle(replica, IndexState.NO_EVENTS)

    def remove(self, replica_id: str) -> None:
        """The replica left the router: drop it and free its slot (its predicted entries too)."""
        replica = self._replicas.pop(replica_id, None)
        if replica is None:
            return
        self._clear(replica)
        self._drop_predicted(replica)
        heapq.heappush(self._free_slots, replica.bit.bit_length() - 1)

    # -- maintenance ----------------------------------------------------------------------------------------------

    def tick(self) -> None:
        """What time alone changes, done (from the Trio thread only; the readers just report it): a RESETTING
        index whose window passed becomes HEALTHY, a suspect replica whose resync had no answer within its
        ``resync_retry`` is asked again, and expired predictions are dropped."""
        now = self.clock()
        for replica in list(self._replicas.values()):  # a listener may forget or remove a replica
            if replica.state is IndexState.RESETTING and now >= replica.resetting_until:
                replica.state = IndexState.HEALTHY
            elif replica.state is IndexState.SUSPECT and now >= replica.resync_retry_at:
                self._ask_resync(replica, replica.last_resync[1] if replica.last_resync else drift_rule.RESYNC_FULL,
                                 "no answer to the last resync request", retry=True)
        self._expire(now)

    async def maintain(self, interval: float = 0.25) -> None:
        """:meth:`tick` every ``interval`` seconds, forever (the gateway runs it in its root nursery): a retry is
        at most that late, which is nothing against ``resync_retry`` (30 s by default)."""
        while True:
            self.tick()
            await trio.sleep(interval)

    # -- applying changes -----------------------------------------------------------------------------------------

    def apply(self, replica_id: str, changes: ChangesFields) -> None:
        """DELTA adds and removes keys, FULL replaces the replica's keys, RESET clears that replica only."""
        replica = self._replica(replica_id)
        now = self.clock()
        replica.updated_at = now
        if changes.block_size:
            replica.block_size = changes.block_size
        kind = changes.kind
        if kind is KvChangeKind.DELTA:
            if changes.stored and replica.unsettled:
                self._settle_by_stores(replica, changes.stored)
            self._remove_keys(replica, changes.removed)
            self._add_keys(replica, changes.stored)
            replica.changes += len(changes.stored) + len(changes.removed)
            if replica.state is IndexState.NO_EVENTS or (replica.state is IndexState.RESETTING and changes.stored):
                replica.state = IndexState.HEALTHY  # (a suspect index stays suspect until its FULL or RESET)
        elif kind is KvChangeKind.FULL:
            new = set(changes.stored)
            old = replica.keys
            self._remove_keys(replica, [k for k in old if k not in new])
            self._add_keys(replica, [k for k in new if k not in old])
            replica.changes += len(new)
            self._settle(replica, IndexState.HEALTHY)
        else:  # RESET, or an unknown kind (decoded as RESET: forget rather than trust)
            self._clear(replica)
            self._drop_predicted(replica)
            self._settle(replica, IndexState.RESETTING)
            replica.reason = changes.reason or "reset"
            replica.resetting_until = now + self.reset_window
            replica.resets += 1

    def _add_keys(self, replica: _Replica, keys: Iterable[int]) -> None:
        holders, bit, mine = self._holders, replica.bit, replica.keys
        for key in keys:
            if key not in mine:
                mine.add(key)
                holders[key] = holders.get(key, 0) | bit

    def _remove_keys(self, replica: _Replica, keys: Iterable[int]) -> None:
        holders, bit, mine = self._holders, replica.bit, replica.keys
        predicted = replica.predicted
        for key in keys:
            if predicted:
                entry = predicted.get(key)
                if entry is not None and not entry[UNSETTLED]:  # no request that may store it again is pending
                    self._drop_entry(replica, key)
            if key in mine:
                mine.discard(key)
                mask = holders[key] & ~bit
                if mask:
                    holders[key] = mask
                else:
                    del holders[key]

    def _clear(self, replica: _Replica) -> None:
        self._remove_keys(replica, list(replica.keys))

    @staticmethod
    def _settle(replica: _Replica, state: IndexState) -> None:
        """A FULL, RESET or forget: a new index for this replica (drift seen so far was about the old one)."""
        replica.state = state
        replica.epoch += 1
        replica.over_times.clear()
        replica.suspect_reason = ""

    # -- drift and resyncs ----------------------------------------------------------------------------------------

    def add_resync_listener(self, listener: ResyncListener) -> None:
        """``listener(replica_id, mode, reason)`` is called when a replica's index turns suspect (and again,
        by :meth:`tick`, every ``resync_retry`` seconds while it stays so), always from the Trio thread; it
        ignores replicas it does not feed, and must not block (post a message, set a flag)."""
        self._resync_listeners.append(listener)

    def remove_resync_listener(self, listener: ResyncListener) -> None:
        if listener in self._resync_listeners:
            self._resync_listeners.remove(listener)

    def observe(self, replica_id: str, result: str, *, epoch: int,
                policy: DriftPolicy = DEFAULT_DRIFT_POLICY) -> str | None:
        """Count one drift check of a response (``match``, ``over`` or ``under``: :func:`llmgw.kv.drift.classify`)
        for a decision made on ``epoch``; the resync mode asked for when this check made the index suspect.

        Every check is counted; only ``over`` checks of decisions made on the current epoch (after the last
        FULL, RESET or forget) of a replica healthy now count towards suspect.
        """
        replica = self._replicas.get(replica_id)
        if replica is None:
            return None
        replica.drift[result] = replica.drift.get(result, 0) + 1
        if result != drift_rule.OVER or policy.suspect_after <= 0 or replica.epoch != epoch \
                or self.state(replica_id) is not IndexState.HEALTHY:
            return None
        now = self.clock()
        times = replica.over_times
        times.append(now)
        while times and times[0] <= now - policy.window:
            times.popleft()
        if len(times) < policy.suspect_after:
            return None
        last = replica.last_resync
        relapse = last is not None and last[1] == drift_rule.RESYNC_FULL and now - last[0] < policy.relapse_window
        mode = drift_rule.RESYNC_RESET if relapse else drift_rule.RESYNC_FULL
        replica.state = IndexState.SUSPECT
        replica.resync_every = policy.resync_retry
        reason = (f"{len(times)} responses within {policy.window:g}s had fewer cached tokens than the "
                  "engine's own events promised")
        replica.suspect_reason = reason + (" (again after a full copy)" if relapse else "")
        times.clear()
        self._ask_resync(replica, mode, replica.suspect_reason)
        return mode

    def _ask_resync(self, replica: _Replica, mode: str, reason: str, *, retry: bool = False) -> None:
        now = self.clock()
        replica.resync_retry_at = now + replica.resync_every
        if not retry:
            replica.last_resync = (now, mode)
        replica.resyncs[mode] += 1
        log.warning("replica %s: KV index suspect (%s): asking its owner for a %s resync", replica.name, reason,
                    mode)
        for listener in list(self._resync_listeners):
            try:
                listener(replica.name, mode, reason)
            except Exception:  # one broken listener must not stop the others nor the response's accounting
                log.exception("resync listener %r failed for replica %s", listener, replica.name)

    # -- predicted entries ----------------------------------------------------------------------------------------

    def add_prediction_listener(self, listener: PredictionListener) -> None:
        """``listener(replica_id, keys, ttl)`` is called by :meth:`predict` for every prediction of this process
        (not the ``remote`` ones), with its resolved ``ttl`` in seconds. It runs on the routing path, from the
        Trio thread: it must only record (an append to a bounded buffer), and must neither change ``keys`` nor
        expect them to stay alive beyond that buffer. An exception it raises is logged and routing goes on."""
        self._prediction_listeners.append(listener)

    def remove_prediction_listener(self, listener: PredictionListener) -> None:
        if listener in self._prediction_listeners:
            self._prediction_listeners.remove(listener)

    def predict(self, replica_id: str, keys: Sequence[int], ttl: float | None = None, *,
                remote: bool = False) -> Prediction | None:
        """``replica_id`` was just sent a request with these block keys: count them as held there for ``ttl``
        seconds (unsettled: see the module's docstring). None when there is nothing to predict.

        ``remote``: another gateway process made this prediction (:mod:`llmgw.cluster.learn`): the prediction
        listeners do not hear it, and a replica the index does not know is refused (None) rather than given a
        slot (that replica is not this process's to add: its slot would outlive it, and the control process
        would publish it).
        """
        if not keys:
            return None
        if remote:
            if replica_id not in self._replicas:
                return None
        elif self._prediction_listeners:
            ttl = self.predicted_ttl if ttl is None else ttl
            for listener in self._prediction_listeners:
                try:
                    listener(replica_id, keys, ttl)
                except Exception:  # sharing a prediction must never fail the request that made it
                    log.exception("prediction listener %r failed for replica %s", listener, replica_id)
        now = self.clock()
        self._expire(now)
        replica = self._replica(replica_id)
        bit, masks, predicted = replica.bit, self._pred_mask, replica.predicted
        entries: list[tuple[int, list[int]]] = []
        for key in keys:
            entry = predicted.get(key)
            if entry is None:
                entry = predicted[key] = [1, 1]
                masks[key] = masks.get(key, 0) | bit
            else:
                entry[HOLDS] += 1
                entry[UNSETTLED] += 1
            entries.append((key, entry))
        expiry = now + (self.predicted_ttl if ttl is None else ttl)
        prediction = Prediction(replica, next(self._pred_serial), expiry, keys, entries)
        replica.unsettled[prediction.serial] = prediction
        heapq.heappush(self._pred_heap, (expiry, prediction))
        return prediction

    def settle(self, prediction: Prediction | None) -> None:
        """The engine served every block of ``prediction`` it was predicted to hold from its cache: none of them
        will be stored again, so a removal reported from now on is an eviction (it drops the entry)."""
        if prediction is None or prediction.settled or not prediction.live:
            return
        prediction.settled = True
        del prediction.replica.unsettled[prediction.serial]
        current = prediction.replica.predicted
        for key, entry in prediction.entries:
            if current.get(key) is entry:
                entry[UNSETTLED] -= 1

    def unpredict(self, prediction: Prediction | None) -> None:
        """Drop ``prediction`` now (the attempt failed: the engine may never see the request)."""
        if prediction is not None and prediction.live:
            self._release(prediction)

    def _settle_by_stores(self, replica: _Replica, stored: Sequence[int]) -> None:
        """A store of any of an unsettled prediction's keys: its prefill's events are in, it settles."""
        stored_set = set(stored)
        for prediction in [p for p in replica.unsettled.values() if not p.keys.isdisjoint(stored_set)]:
            self.settle(prediction)

    def _release(self, prediction: Prediction) -> None:
        prediction.live = False
        replica = prediction.replica
        if not prediction.settled:
            replica.unsettled.pop(prediction.serial, None)
        current = replica.predicted
        for key, entry in prediction.entries:
            if current.get(key) is entry:
                entry[HOLDS] -= 1
                if not prediction.settled:
                    entry[UNSETTLED] -= 1
                if not entry[HOLDS]:
                    self._drop_entry(replica, key)

    def _drop_entry(self, replica: _Replica, key: int) -> None:
        """Drop one replica's predicted entry for ``key`` (it has one); the predictions holding it let it go."""
        del replica.predicted[key]
        mask = self._pred_mask[key] & ~replica.bit
        if mask:
            self._pred_mask[key] = mask
        else:
            del self._pred_mask[key]

    def _drop_predicted(self, replica: _Replica) -> None:
        """Drop every predicted entry of one replica (its engine's cache was reset, or it is gone)."""
        for key in list(replica.predicted):
            self._drop_entry(replica, key)
        for prediction in replica.unsettled.values():
            prediction.settled = True  # its entries are gone: nothing left to count
        replica.unsettled.clear()

    def _expire(self, now: float) -> None:
        heap = self._pred_heap
        while heap and heap[0][0] <= now:
            _, prediction = heapq.heappop(heap)
            if prediction.live:
                self._release(prediction)

    @property
    def predicted_keys(self) -> int:
        """Keys some replica has a live predicted entry for: held by a prediction not expired yet.

        A reader: it leaves expired predictions to the next writer, so it counts them out instead.
        """
        now = self.clock()
        held: set[int] = set()
        for expiry, prediction in self._pred_heap:
            if prediction.live and expiry > now:
                current = prediction.replica.predicted
                held.update(key for key, entry in prediction.entries if current.get(key) is entry)
        return len(held)

    # -- matching -------------------------------------------------------------------------------------------------

    def match(self, keys: Sequence[int], replica_ids: Iterable[str], *, predicted: bool = True) -> dict[str, int]:
        """Per replica, how many LEADING blocks of ``keys`` (contiguous from block 0) it holds.

        With ``predicted`` (the default) live predicted entries count as held;
        :meth:`match_detail` tells confirmed and predicted apart.
        """
        detail = self.match_detail(keys, replica_ids, predicted=predicted)
        return {rid: run for rid, (_, run) in detail.items()}

    def match_detail(self, keys: Sequence[int], replica_ids: Iterable[str], *,
                     predicted: bool = True) -> dict[str, tuple[int, int]]:
        """Per replica ``(confirmed, with_predicted)`` leading blocks; ``with_predicted >= confirmed``.

        One walk from block 0 with one or two dict lookups per block, ending at
        the first block no candidate holds (confirmed or predicted).
        """
        ids = list(replica_ids)
        confirmed = dict.fromkeys(ids, 0)
        total = dict.fromkeys(ids, 0)
        bits: list[tuple[str, int]] = []
        alive = 0
        for rid in ids:
            replica = self._replicas.get(rid)
            if replica is not None:
                bits.append((rid, replica.bit))
                alive |= replica.bit
        if predicted:
            self._expire(self.clock())
        if alive:
            holders = self._holders.get
            guesses = self._pred_mask.get if predicted and self._pred_mask else None
            alive_c = alive_t = alive
            end = len(keys)
            for index, key in enumerate(keys):
                held = holders(key, 0)
                if alive_c and alive_c & held != alive_c:
                    still = alive_c & held
                    for rid, bit in bits:
                        if (alive_c ^ still) & bit:
                            confirmed[rid] = index
                    alive_c = still
                if guesses is not None:
                    held |= guesses(key, 0)
                if alive_t & held != alive_t:
                    still = alive_t & held
                    for rid, bit in bits:
                        if (alive_t ^ still) & bit:
                            total[rid] = index
                    alive_t = still
                    if not alive_t:
                        break
            else:
                for rid, bit in bits:
                    if alive_c & bit:
                        confirmed[rid] = end
                    if alive_t & bit:
                        total[rid] = end
        return {rid: (confirmed[rid], total[rid]) for rid in ids}


def refusal_reason(changes: object, sender_node: str, placed_on: str | None) -> str | None:
    """Why the control plane must refuse ``changes`` from ``sender_node``, or None to accept them.

    ``placed_on`` is the node the control plane placed ``changes.replica_id``'s
    shard ``changes.shard_id`` on (None when it placed no such shard). Reasons
    label ``llmgw_kv_changes_refused_total``.
    """
    if placed_on is None:
        return "unknown_replica"
    if placed_on != sender_node:
        return "foreign_replica"
    return None
