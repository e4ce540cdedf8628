"""The KV index's health tracker: per replica, whether its block index can be trusted, and the resyncs it asks.

One part of the router's :class:`~llmgw.kv.index.KvIndex` (with the confirmed block index,
:mod:`llmgw.kv.blocks`, and the prediction overlay, :mod:`llmgw.kv.predictions`). It holds no block keys: it
hears what kind of change arrived (:meth:`IndexHealth.delta`, ``full``, ``reset``, ``forget``) and the drift
checks of responses (:meth:`IndexHealth.observe`), and keeps per replica a state:

- ``no_events``: nothing received yet (or the agent's stream was lost:
  :meth:`IndexHealth.forget`); the tier routes it as the prefix tree would;
- ``healthy``: a FULL copy or a DELTA arrived;
- ``resetting``: a RESET arrived (engine restart, ``AllBlocksCleared``, a gap
  replay could not fill); ends with the next FULL, the next DELTA storing
  blocks, or after ``reset_window`` seconds, whichever comes first;
- ``suspect``: the engine's reported cached tokens contradicted the index
  too often (:meth:`IndexHealth.observe`, the rule in :mod:`llmgw.kv.drift`);
  the replica's owner was asked to resync (the resync listeners), again every
  ``resync_retry`` seconds while no answer came (by :meth:`IndexHealth.tick`);
  ends with the next FULL or RESET (the answer), or ``forget``;
- ``unusable_keys``: a FULL copy said its keys can never match the router's
  (:func:`~llmgw.kv.changes.unusable_keys_reason`: the engine's block hashes
  differ from the router's ``vllm`` keys, or content keys are impossible
  because the events carry no ``token_ids``); ``describe`` gives the fix in
  words; the tier routes it as the prefix tree would; ends with the next FULL
  without that reason, a RESET, or ``forget``.

and an *epoch*, bumped by every FULL, RESET and forget: a decision is tagged with the epoch it was made on, and
drift seen on an older epoch is about an index that is gone.

Threads: the readers (``state``, ``healthy``, ``epoch``, ``describe``, ``resyncs``) never write, and may run in
the worker thread that renders ``/metrics``. Only the Trio thread writes, and only a writer calls the resync
listeners. So what changes with time alone is *reported* by the readers (a ``resetting`` replica whose window
passed reads as ``healthy``) and *done* by :meth:`IndexHealth.tick`: it folds that ``resetting`` into
``healthy`` and asks again for the resyncs of suspect replicas whose retry is due.

A replica this tracker has heard nothing of reads as a new one: ``no_events``, epoch 0, nothing counted.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from enum import Enum
from typing import Any

from . import drift as drift_rule
from .changes import unusable_keys_problem
from .drift import DriftPolicy

log = logging.getLogger(__name__)

DEFAULT_RESET_WINDOW = 5.0
DEFAULT_DRIFT_POLICY = DriftPolicy()


class IndexState(str, Enum):
    NO_EVENTS = "no_events"
    HEALTHY = "healthy"
    RESETTING = "resetting"
    SUSPECT = "suspect"
    UNUSABLE_KEYS = "unusable_keys"


ResyncListener = Callable[[str, str, str], None]  # (replica id, mode: "full" or "reset", reason)


class _Health:
    """One replica's state, drift counts and resync requests."""

    __slots__ = ("state", "reason", "resetting_until", "resets", "epoch", "drift", "over_times", "suspect_reason",
                 "resyncs", "last_resync", "resync_retry_at", "resync_every", "problem")

    def __init__(self) -> None:
        self.state = IndexState.NO_EVENTS
        self.reason = ""
        self.resetting_until = 0.0
        self.resets = 0
        self.epoch = 0  # bumped by every FULL, RESET and forget: drift seen before it is about an older index
        self.drift = {drift_rule.MATCH: 0, drift_rule.OVER: 0, drift_rule.UNDER: 0}
        self.over_times: deque[float] = deque()  # when recent `over` drifts were seen (within the policy's window)
        self.suspect_reason = ""
        self.resyncs = {mode: 0 for mode in drift_rule.RESYNC_MODES}  # resync requests, by mode
        self.last_resync: tuple[float, str] | None = None  # (when, mode) of the last resync asked for
        self.resync_retry_at = 0.0
        self.resync_every = drift_rule.DEFAULT_RESYNC_RETRY
        self.problem = ""  # unusable_keys: why, and the fix


class IndexHealth:
    def __init__(self, *, clock: Callable[[], float] = time.monotonic, reset_window: float = DEFAULT_RESET_WINDOW):
        self.clock = clock
        self.reset_window = reset_window
        self._replicas: dict[str, _Health] = {}
        self._listeners: list[ResyncListener] = []

    def _record(self, replica_id: str) -> _Health:
        health = self._replicas.get(replica_id)
        if health is None:
            health = self._replicas[replica_id] = _Health()
        return health

    # -- readers --------------------------------------------------------------------------------------------------

    def state(self, replica_id: str, now: float | None = None) -> IndexState:
        """The replica's state at ``now`` (the clock's when None); changes nothing."""
        health = self._replicas.get(replica_id)
        if health is None:
            return IndexState.NO_EVENTS
        return self._state_at(health, self.clock() if now is None else now)

    @staticmethod
    def _state_at(health: _Health, now: float) -> IndexState:
        """A RESETTING index whose window has passed is HEALTHY (an empty cache is a known state) even before
        :meth:`tick` stores that."""
        if health.state is IndexState.RESETTING and now >= health.resetting_until:
            return IndexState.HEALTHY
        return health.state

    def healthy(self, replica_id: str) -> bool:
        return self.state(replica_id) is IndexState.HEALTHY

    def epoch(self, replica_id: str) -> int:
        """Bumped by every FULL, RESET and forget of the replica: tags a decision with the index it was made on."""
        health = self._replicas.get(replica_id)
        return health.epoch if health is not None else 0

    def resyncs(self, replica_id: str) -> dict[str, int]:
        """``{mode: resync requests}`` of the replica."""
        health = self._replicas.get(replica_id)
        return dict(health.resyncs) if health is not None else {mode: 0 for mode in drift_rule.RESYNC_MODES}

    def describe(self, replica_id: str) -> dict[str, Any]:
        """The replica's state, resets and drift, as JSON-able data."""
        health = self._replicas.get(replica_id) or _Health()
        now = self.clock()
        last = health.last_resync
        return {"state": self._state_at(health, now).value, "last_reset_reason": health.reason or None,
                "resets": health.resets,
                "drift": {**health.drift, "recent_over": len(health.over_times),
                          "suspect_reason": health.suspect_reason or None, "resyncs": dict(health.resyncs),
                          "last_resync": last[1] if last else None,
                          "last_resync_ago": round(now - last[0], 3) if last else None},
                "problem": health.problem or None}

    # -- what arrived ---------------------------------------------------------------------------------------------

    def delta(self, replica_id: str, stored: bool) -> None:
        """A DELTA arrived (``stored``: it stored blocks): ``no_events`` becomes healthy, and so does ``resetting``
        when blocks were stored. A suspect index stays suspect until its FULL or RESET."""
        health = self._record(replica_id)
        if health.state is IndexState.NO_EVENTS or (health.state is IndexState.RESETTING and stored):
            health.state = IndexState.HEALTHY

    def full(self, replica_id: str, reason: str = "") -> None:
        """A FULL copy arrived: a new, healthy index; ``unusable_keys`` when its ``reason`` says its keys cannot
        match the router's (:func:`~llmgw.kv.changes.unusable_keys_problem`)."""
        health = self._record(replica_id)
        problem, before = unusable_keys_problem(reason), health.problem
        self._new_index(health, IndexState.HEALTHY if problem is None else IndexState.UNUSABLE_KEYS)
        if problem is not None:
            if before != problem:
                log.warning("replica %s: KV index unusable, routed by the prefix tree: %s", replica_id, problem)
            health.problem = problem

    def reset(self, replica_id: str, reason: str) -> None:
        """A RESET arrived: a new, empty index, ``resetting`` for ``reset_window`` seconds."""
        health = self._record(replica_id)
        self._new_index(health, IndexState.RESETTING)
        health.reason = reason
        health.resetting_until = self.clock() + self.reset_window
        health.resets += 1

    def forget(self, replica_id: str) -> None:
        """The replica's stream was lost: back to ``no_events``, on a new epoch."""
        self._new_index(self._record(replica_id), IndexState.NO_EVENTS)

    def remove(self, replica_id: str) -> None:
        """The replica left: forget all of it."""
        self._replicas.pop(replica_id, None)

    @staticmethod
    def _new_index(health: _Health, state: IndexState) -> None:
        """A FULL, RESET or forget: a new index for this replica (drift seen so far was about the old one)."""
        health.state = state
        health.problem = ""
        health.epoch += 1
        health.over_times.clear()
        health.suspect_reason = ""

    # -- drift and resyncs ----------------------------------------------------------------------------------------

    def add_resync_listener(self, listener: ResyncListener) -> None:
        """``listener(replica_id, mode, reason)`` is called when a replica's index turns suspect (and again,
        by :meth:`tick`, every ``resync_retry`` seconds while it stays so), always from the Trio thread; it
        ignores replicas it does not feed, and must not block (post a message, set a flag)."""
        self._listeners.append(listener)

    def remove_resync_listener(self, listener: ResyncListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def observe(self, replica_id: str, result: str, *, epoch: int,
                policy: DriftPolicy = DEFAULT_DRIFT_POLICY) -> str | None:
        """Count one drift check of a response (``match``, ``over`` or ``under``: :func:`llmgw.kv.drift.classify`)
        for a decision made on ``epoch``; the resync mode asked for when this check made the index suspect.

        Every check is counted; only ``over`` checks of decisions made on the current epoch (after the last
        FULL, RESET or forget) of a replica healthy now count towards suspect.
        """
        health = self._record(replica_id)
        health.drift[result] = health.drift.get(result, 0) + 1
        now = self.clock()
        if result != drift_rule.OVER or policy.suspect_after <= 0 or health.epoch != epoch \
                or self._state_at(health, now) is not IndexState.HEALTHY:
            return None
        times = health.over_times
        times.append(now)
        while times and times[0] <= now - policy.window:
            times.popleft()
        if len(times) < policy.suspect_after:
            return None
        last = health.last_resync
        relapse = last is not None and last[1] == drift_rule.RESYNC_FULL and now - last[0] < policy.relapse_window
        mode = drift_rule.RESYNC_RESET if relapse else drift_rule.RESYNC_FULL
        health.state = IndexState.SUSPECT
        health.resync_every = policy.resync_retry
        reason = (f"{len(times)} responses within {policy.window:g}s had fewer cached tokens than the "
                  "engine's own events promised")
        health.suspect_reason = reason + (" (again after a full copy)" if relapse else "")
        times.clear()
        self._ask_resync(replica_id, health, mode, health.suspect_reason)
        return mode

    def _ask_resync(self, replica_id: str, health: _Health, mode: str, reason: str, *, retry: bool = False) -> None:
        now = self.clock()
        health.resync_retry_at = now + health.resync_every
        if not retry:
            health.last_resync = (now, mode)
        health.resyncs[mode] += 1
        log.warning("replica %s: KV index suspect (%s): asking its owner for a %s resync", replica_id, reason, mode)
        for listener in list(self._listeners):
            try:
                listener(replica_id, mode, reason)
            except Exception:  # one broken listener must not stop the others nor the response's accounting
                log.exception("resync listener %r failed for replica %s", listener, replica_id)

    # -- time -----------------------------------------------------------------------------------------------------

    def tick(self, now: float | None = None) -> None:
        """What time alone changes, done (from the Trio thread only; the readers just report it): a RESETTING
        index whose window passed becomes HEALTHY, and a suspect replica whose resync had no answer within its
        ``resync_retry`` is asked again."""
        now = self.clock() if now is None else now
        for replica_id, health in list(self._replicas.items()):  # a listener may forget or remove a replica
            if health.state is IndexState.RESETTING and now >= health.resetting_until:
                health.state = IndexState.HEALTHY
            elif health.state is IndexState.SUSPECT and now >= health.resync_retry_at:
                self._ask_resync(replica_id, health,
                                 health.last_resync[1] if health.last_resync else drift_rule.RESYNC_FULL,
                                 "no answer to the last resync request", retry=True)
