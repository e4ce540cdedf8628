"""The prediction overlay: block keys of requests just routed, counted as held on their replica for a while.

One part of the router's :class:`~llmgw.kv.index.KvIndex` (with the confirmed block index,
:mod:`llmgw.kv.blocks`, and the health tracker, :mod:`llmgw.kv.health`). A :class:`Prediction` records a
request just routed, so that a burst of requests sharing a new prefix co-locates before the engine's events
arrive. Predicted entries live apart from the confirmed ones, never change them, and count in matching (the
overlay's :attr:`PredictionOverlay.masks`, keyed by the block index's slot bits), not in the block counts nor
the gauges. Each lasts ``ttl`` seconds (default 2) unless dropped earlier (:meth:`PredictionOverlay.unpredict`:
the attempt failed).

A removal the engine reports for a predicted block is ambiguous while the
request is *unsettled*: the engine may have evicted the block before it
admitted the request (it recomputes and stores it again, and that store is
still on its way), or after (the cache is gone). So a removal
(:meth:`PredictionOverlay.evicted`) drops a replica's predicted entry only when no unsettled prediction holds
it. A prediction settles when a store of one of its blocks arrives (:meth:`PredictionOverlay.stored`: its
prefill's events are in, later removals are newer), or when the response showed every predicted block served
from cache (:meth:`PredictionOverlay.settle`: nothing of it will be stored again). Without that, a request
routed right after another one whose eviction and re-store were in flight was predicted fewer blocks than the
engine held (seen with vLLM, back to back requests).

A reset of the replica's cache, a lost stream or the replica leaving drops all of its predicted entries
(:meth:`PredictionOverlay.drop`: its engine holds none of them any more).

Listeners (:meth:`PredictionOverlay.add_listener`) hear every prediction made with ``share`` (this process's
tiers), so that other gateway processes can apply it too (:mod:`llmgw.cluster.learn`); those processes'
predictions come back without ``share``: they count and end like local ones, but no listener hears them (no
echo).

Threads: only the Trio thread writes (``predict``, ``settle``, ``unpredict``, ``stored``, ``evicted``,
``drop``, ``expire``); :attr:`PredictionOverlay.predicted_keys` is a reader, and leaves expired predictions to
the next writer.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

log = logging.getLogger(__name__)

DEFAULT_PREDICTED_TTL = 2.0

PredictionListener = Callable[[str, Sequence[int], float], None]  # (replica id, block keys, ttl in seconds)

HOLDS, UNSETTLED = 0, 1  # a predicted entry: [live predictions holding the key, how many of them unsettled]


class _Predicted:
    """One replica's predicted entries and its predictions not settled yet."""

    __slots__ = ("name", "bit", "entries", "unsettled")

    def __init__(self, name: str, bit: int):
        self.name = name
        self.bit = bit
        self.entries: dict[int, list[int]] = {}  # key -> [live predictions holding it, unsettled ones]
        self.unsettled: dict[int, Prediction] = {}  # serial -> live predictions not settled yet


class Prediction:
    """A request routed to a replica, its block keys counted as held there until it expires or is dropped.

    Returned by :meth:`PredictionOverlay.predict` (and :meth:`~llmgw.kv.index.KvIndex.predict`); the tier
    passes it back to ``settle`` and ``unpredict``.
    """

    __slots__ = ("replica", "serial", "expiry", "keys", "entries", "settled", "live")

    def __init__(self, replica: _Predicted, serial: int, expiry: float, keys: Sequence[int],
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


class PredictionOverlay:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic, ttl: float = DEFAULT_PREDICTED_TTL):
        self.clock = clock
        self.ttl = ttl
        self._replicas: dict[str, _Predicted] = {}
        self._masks: dict[int, int] = {}  # key -> bitmask of the replica slots predicting it
        self._heap: list[tuple[float, Prediction]] = []  # live predictions by expiry
        self._serial = itertools.count()
        self._listeners: list[PredictionListener] = []

    @property
    def masks(self) -> Mapping[int, int]:
        """``key -> bits of the replicas with a predicted entry for it`` (expired ones included until
        :meth:`expire`), for :meth:`~llmgw.kv.blocks.BlockIndex.match_detail`: the same mapping for the overlay's
        life, changed in place. Read it, never change it."""
        return self._masks

    # -- listeners ------------------------------------------------------------------------------------------------

    def add_listener(self, listener: PredictionListener) -> None:
        """``listener(replica_id, keys, ttl)`` is called by :meth:`predict` for every prediction made with
        ``share``, with its resolved ``ttl`` in seconds. It runs on the routing path, from the Trio thread: it must
        only record (an append to a bounded buffer), and must neither change ``keys`` nor expect them to stay
        alive beyond that buffer. An exception it raises is logged and routing goes on."""
        self._listeners.append(listener)

    def remove_listener(self, listener: PredictionListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    # -- predictions ----------------------------------------------------------------------------------------------

    def predict(self, replica_id: str, bit: int, keys: Sequence[int], ttl: float | None = None, *,
                share: bool = True) -> Prediction | None:
        """``replica_id`` (slot ``bit``) was just sent a request with these block keys: count them as held there
        for ``ttl`` seconds (the overlay's default when None), unsettled. None when there is nothing to predict.

        ``share``: the listeners hear it (a prediction of this process; not one another process made).
        """
        if not keys:
            return None
        ttl = self.ttl if ttl is None else ttl
        if share:
            for listener in self._listeners:
                try:
                    listener(replica_id, keys, ttl)
                except Exception:  # sharing a prediction must never fail the request that made it
                    log.exception("prediction listener %r failed for replica %s", listener, replica_id)
        now = self.clock()
        self.expire(now)
        replica = self._replicas.get(replica_id)
        if replica is None:
            replica = self._replicas[replica_id] = _Predicted(replica_id, bit)
        masks, predicted = self._masks, replica.entries
        bit = replica.bit
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
        expiry = now + ttl
        prediction = Prediction(replica, next(self._serial), expiry, keys, entries)
        replica.unsettled[prediction.serial] = prediction
        heapq.heappush(self._heap, (expiry, prediction))
        return prediction

    def settle(self, prediction: Prediction | None) -> None:
        """The engine served every block of ``prediction`` it was predicted to hold from its cache: none of them
        will be stored again, so a removal reported from now on is an eviction (it drops the entry)."""
        if prediction is None or prediction.settled or not prediction.live:
            return
        prediction.settled = True
        del prediction.replica.unsettled[prediction.serial]
        current = prediction.replica.entries
        for key, entry in prediction.entries:
            if current.get(key) is entry:
                entry[UNSETTLED] -= 1

    def unpredict(self, prediction: Prediction | None) -> None:
        """Drop ``prediction`` now (the attempt failed: the engine may never see the request)."""
        if prediction is not None and prediction.live:
            self._release(prediction)

    # -- what the engine reported ---------------------------------------------------------------------------------

    def stored(self, replica_id: str, keys: Iterable[int]) -> None:
        """The engine stored ``keys``: every unsettled prediction holding any of them settles (its prefill's
        events are in)."""
        replica = self._replicas.get(replica_id)
        if replica is None or not replica.unsettled:
            return
        stored_set = set(keys)
        for prediction in [p for p in replica.unsettled.values() if not p.keys.isdisjoint(stored_set)]:
            self.settle(prediction)

    def evicted(self, replica_id: str, keys: Iterable[int]) -> None:
        """The engine removed ``keys``: drop the replica's predicted entries for them that no unsettled
        prediction holds (one that does may store them again)."""
        replica = self._replicas.get(replica_id)
        if replica is None:
            return
        predicted = replica.entries
        if not predicted:
            return
        for key in filter(predicted.__contains__, keys):  # most removed keys were never predicted: skipped in C
            if not predicted[key][UNSETTLED]:
                self._drop_entry(replica, key)

    def drop(self, replica_id: str) -> None:
        """Drop every predicted entry of the replica (its engine's cache was reset, its stream lost, or it left:
        its slot may go to another replica next)."""
        replica = self._replicas.pop(replica_id, None)
        if replica is None:
            return
        for key in list(replica.entries):
            self._drop_entry(replica, key)
        for prediction in replica.unsettled.values():
            prediction.settled = True  # its entries are gone: nothing left to count
        replica.unsettled.clear()

    # -- time -----------------------------------------------------------------------------------------------------

    def expire(self, now: float | None = None) -> None:
        """Drop the predictions whose ttl has passed."""
        heap = self._heap
        if not heap:
            return
        if now is None:
            now = self.clock()
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
        for expiry, prediction in self._heap:
            if prediction.live and expiry > now:
                current = prediction.replica.entries
                held.update(key for key, entry in prediction.entries if current.get(key) is entry)
        return len(held)

    # -- entries --------------------------------------------------------------------------------------------------

    def _release(self, prediction: Prediction) -> None:
        prediction.live = False
        replica = prediction.replica
        if not prediction.settled:
            replica.unsettled.pop(prediction.serial, None)
        current = replica.entries
        for key, entry in prediction.entries:
            if current.get(key) is entry:
                entry[HOLDS] -= 1
                if not prediction.settled:
                    entry[UNSETTLED] -= 1
                if not entry[HOLDS]:
                    self._drop_entry(replica, key)

    def _drop_entry(self, replica: _Predicted, key: int) -> None:
        """Drop one replica's predicted entry for ``key`` (it has one); the predictions holding it let it go."""
        del replica.entries[key]
        mask = self._masks[key] & ~replica.bit
        if mask:
            self._masks[key] = mask
        else:
            del self._masks[key]
