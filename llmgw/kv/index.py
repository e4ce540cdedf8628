"""The router's KV index: which block keys each replica's engine holds, and how many leading blocks of a prompt.

One :class:`KvIndex` per router, fed with :class:`~llmgw.kv.changes.BlockChanges` (the control plane's
:class:`llmgw.wire.KvChanges` have the same fields) by ``apply``, read by the ``kv_index`` tier (``match``,
through the :class:`KvIndexView` it is given).

It is the composition of three parts, each with one job and testable alone:

- :class:`~llmgw.kv.blocks.BlockIndex` (``confirmed``): the confirmed blocks, what the engines' events said,
  per replica slot, and the walk of a prompt's keys over them (``match``);
- :class:`~llmgw.kv.predictions.PredictionOverlay` (``predictions``): the blocks of requests just routed,
  counted as held for a few seconds before the engine's events arrive (``predict``, ``settle``,
  ``unpredict``), shared with other gateway processes through its listeners;
- :class:`~llmgw.kv.health.IndexHealth` (``health``): per replica, whether its index can be trusted
  (``no_events``, ``healthy``, ``resetting``, ``suspect``, ``unusable_keys``), its epochs, the drift checks of responses
  (``observe``) and the resyncs they ask for.

This class routes each change to the parts it concerns (a DELTA's stores settle predictions and its removals
may drop predicted entries; a RESET clears the blocks, drops the predictions and starts a reset window; a
``remove`` frees the replica's slot in all three), and keeps one replica list: the block index's. The rules
of each part are in its module's docstring.

Threads: the readers (``state``, ``healthy``, ``summary``, ``describe``, ``drift_summary``, ``predicted_keys``,
``blocks``, ``keys``...) never write: the Prometheus collector calls ``summary`` and ``drift_summary`` from the
worker thread that renders ``/metrics``, while the Trio thread writes. Only the Trio thread writes (``apply``,
``observe``, ``forget``, ``remove``, ``predict``, ``settle``, ``unpredict``, ``match``, which drops expired
predictions, and ``tick``), and only a writer calls the resync listeners. What changes with time alone is done
by :meth:`KvIndex.tick` (the health's reset windows and resync retries, the overlay's expiry), which
:meth:`KvIndex.maintain` runs every 0.25 s in the gateway's root nursery; without it (a unit test) a retry
happens when ``tick`` is called.

Predictions another gateway process made come back through ``predict(..., remote=True)``
(:mod:`llmgw.cluster.learn`): they count and end like local ones, but no prediction listener hears them (no
echo), and they never create a replica the index does not know.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import trio

from .blocks import BlockIndex
from .changes import ChangesFields, KvChangeKind
from .drift import DriftPolicy
from .health import DEFAULT_DRIFT_POLICY, DEFAULT_RESET_WINDOW, IndexHealth, IndexState, ResyncListener
from .predictions import DEFAULT_PREDICTED_TTL, Prediction, PredictionListener, PredictionOverlay

__all__ = ["DEFAULT_DRIFT_POLICY", "DEFAULT_PREDICTED_TTL", "DEFAULT_RESET_WINDOW", "IndexState", "KvIndex",
           "KvIndexView", "Prediction", "PredictionListener", "ResyncListener", "refusal_reason"]


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
        self.confirmed = BlockIndex()
        self.predictions = PredictionOverlay(clock=clock, ttl=predicted_ttl)
        self.health = IndexHealth(clock=clock, reset_window=reset_window)
        self._predicted_masks = self.predictions.masks  # the same mapping for the overlay's life

    @property
    def clock(self) -> Callable[[], float]:
        return self.health.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        """One clock for the parts that read time (a test swaps it after the tier built the index)."""
        self.predictions.clock = self.health.clock = clock

    @property
    def reset_window(self) -> float:
        return self.health.reset_window

    @property
    def predicted_ttl(self) -> float:
        return self.predictions.ttl

    # -- readers --------------------------------------------------------------------------------------------------

    def replicas(self) -> list[str]:
        return self.confirmed.replicas()

    def state(self, replica_id: str) -> IndexState:
        """The replica's state now; changes nothing (any thread may read it: the module's docstring)."""
        return self.health.state(replica_id)

    def healthy(self, replica_id: str) -> bool:
        return self.health.healthy(replica_id)

    def epoch(self, replica_id: str) -> int:
        """Bumped by every FULL, RESET and forget of the replica: tags a decision with the index it was made on."""
        return self.health.epoch(replica_id)

    def block_size(self, replica_id: str) -> int | None:
        return self.confirmed.block_size(replica_id)

    def blocks(self, replica_id: str) -> int:
        return self.confirmed.blocks(replica_id)

    def holds(self, replica_id: str, key: int) -> bool:
        return self.confirmed.holds(replica_id, key)

    def keys(self, replica_id: str) -> set[int]:
        return self.confirmed.keys(replica_id)

    @property
    def predicted_keys(self) -> int:
        """Keys some replica has a live predicted entry for (:attr:`PredictionOverlay.predicted_keys`)."""
        return self.predictions.predicted_keys

    def summary(self) -> dict[str, tuple[int, str]]:
        """``{replica: (blocks, state)}`` for the gauges (read from the scrape's worker thread: the replicas are
        copied in one step, so the Trio thread adding one meanwhile does not break the iteration)."""
        now = self.clock()
        state = self.health.state
        return {name: (size, state(name, now).value) for name, size in self.confirmed.sizes().items()}

    def drift_summary(self) -> dict[str, dict[str, int]]:
        """``{replica: {mode: resync requests}}`` for the metrics (copied as :meth:`summary` does)."""
        return {name: self.health.resyncs(name) for name in self.confirmed.replicas()}

    def describe(self, replica_id: str) -> dict[str, Any]:
        """What the index knows of one replica, as JSON-able data (for explain and the admin API)."""
        confirmed = self.confirmed
        if replica_id not in confirmed:
            return {"state": IndexState.NO_EVENTS.value, "blocks": 0, "block_size": None}
        health = self.health.describe(replica_id)
        return {"state": health["state"], "blocks": confirmed.blocks(replica_id),
                "block_size": confirmed.block_size(replica_id), "last_reset_reason": health["last_reset_reason"],
                "resets": health["resets"], "changes": confirmed.changes(replica_id), "drift": health["drift"],
                "problem": health["problem"]}

    # -- the engines' changes (their owner only) ------------------------------------------------------------------

    def apply(self, replica_id: str, changes: ChangesFields) -> None:
        """DELTA adds and removes keys, FULL replaces the replica's keys, RESET clears that replica only."""
        kind = changes.kind
        if kind is KvChangeKind.DELTA:
            stored, removed = changes.stored, changes.removed
            if stored:
                self.predictions.stored(replica_id, stored)
            if removed:
                self.predictions.evicted(replica_id, removed)
            self.confirmed.update(replica_id, stored, removed, changes.block_size)
            self.health.delta(replica_id, bool(stored))
        elif kind is KvChangeKind.FULL:
            gone = self.confirmed.replace(replica_id, changes.stored, changes.block_size)
            if gone:
                self.predictions.evicted(replica_id, gone)
            self.health.full(replica_id, changes.reason)
        else:  # RESET, or an unknown kind (decoded as RESET: forget rather than trust)
            self.confirmed.clear(replica_id, changes.block_size)
            self.predictions.drop(replica_id)
            self.health.reset(replica_id, changes.reason or "reset")

    def forget(self, replica_id: str) -> None:
        """The agent's stream for this replica was lost: drop what we knew, back to ``no_events``.

        The agent sends a FULL copy when its stream reconnects.
        """
        if replica_id in self.confirmed:
            self.confirmed.clear(replica_id)
            self.predictions.drop(replica_id)
            self.health.forget(replica_id)

    def remove(self, replica_id: str) -> None:
        """The replica left the router: drop it and free its slot (its predicted entries too)."""
        if replica_id in self.confirmed:
            self.confirmed.remove(replica_id)
            self.predictions.drop(replica_id)
            self.health.remove(replica_id)

    # -- drift and resyncs ----------------------------------------------------------------------------------------

    def add_resync_listener(self, listener: ResyncListener) -> None:
        """See :meth:`IndexHealth.add_resync_listener <llmgw.kv.health.IndexHealth.add_resync_listener>`."""
        self.health.add_resync_listener(listener)

    def remove_resync_listener(self, listener: ResyncListener) -> None:
        self.health.remove_resync_listener(listener)

    def observe(self, replica_id: str, result: str, *, epoch: int,
                policy: DriftPolicy = DEFAULT_DRIFT_POLICY) -> str | None:
        """Count one drift check of a response (:meth:`IndexHealth.observe <llmgw.kv.health.IndexHealth.observe>`);
        a replica the index does not know is ignored (None)."""
        if replica_id not in self.confirmed:
            return None
        return self.health.observe(replica_id, result, epoch=epoch, policy=policy)

    # -- predicted entries ----------------------------------------------------------------------------------------

    def add_prediction_listener(self, listener: PredictionListener) -> None:
        """See :meth:`PredictionOverlay.add_listener <llmgw.kv.predictions.PredictionOverlay.add_listener>`: it
        hears every prediction of this process (not the ``remote`` ones)."""
        self.predictions.add_listener(listener)

    def remove_prediction_listener(self, listener: PredictionListener) -> None:
        self.predictions.remove_listener(listener)

    def predict(self, replica_id: str, keys: Sequence[int], ttl: float | None = None, *,
                remote: bool = False) -> Prediction | None:
        """``replica_id`` was just sent a request with these block keys: count them as held there for ``ttl``
        seconds (unsettled: :mod:`llmgw.kv.predictions`). None when there is nothing to predict.

        ``remote``: another gateway process made this prediction (:mod:`llmgw.cluster.learn`): the prediction
        listeners do not hear it, and a replica the index does not know is refused (None) rather than given a
        slot (that replica is not this process's to add: its slot would outlive it, and the control process
        would publish it).
        """
        if not keys or (remote and replica_id not in self.confirmed):
            return None
        return self.predictions.predict(replica_id, self.confirmed.bit(replica_id), keys, ttl, share=not remote)

    def settle(self, prediction: Prediction | None) -> None:
        """See :meth:`PredictionOverlay.settle <llmgw.kv.predictions.PredictionOverlay.settle>`."""
        self.predictions.settle(prediction)

    def unpredict(self, prediction: Prediction | None) -> None:
        """Drop ``prediction`` now (the attempt failed: the engine may never see the request)."""
        self.predictions.unpredict(prediction)

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
        """Per replica ``(confirmed, with_predicted)`` leading blocks; ``with_predicted >= confirmed``
        (:meth:`BlockIndex.match_detail <llmgw.kv.blocks.BlockIndex.match_detail>` over the live predictions)."""
        if not predicted:
            return self.confirmed.match_detail(keys, replica_ids)
        self.predictions.expire()
        return self.confirmed.match_detail(keys, replica_ids, self._predicted_masks)

    # -- maintenance ----------------------------------------------------------------------------------------------

    def tick(self) -> None:
        """What time alone changes, done (from the Trio thread only; the readers just report it): a RESETTING
        index whose window passed becomes HEALTHY, a suspect replica whose resync had no answer within its
        ``resync_retry`` is asked again, and expired predictions are dropped."""
        now = self.clock()
        self.health.tick(now)
        self.predictions.expire(now)

    async def maintain(self, interval: float = 0.25) -> None:
        """:meth:`tick` every ``interval`` seconds, forever (the gateway runs it in its root nursery): a retry is
        at most that late, which is nothing against ``resync_retry`` (30 s by default)."""
        while True:
            self.tick()
            await trio.sleep(interval)


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
