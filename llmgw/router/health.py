"""Replica health: active ``/health`` probes on an interval plus passive failure counting.

A replica goes down after ``failures_to_down`` failed probes in a row, or
``passive_failures_to_down`` failed requests in a row; it comes back after
``successes_to_up`` good probes. Only failures that say the replica is unwell
are passive failures (the data plane decides which). Passive failures alone
never keep a replica whose probe passes out for longer than one probe
interval: going down on them wakes its prober at once, and the first probe
that passes brings it back. Every change is logged with its reason and shown
in ``llmgw_replica_up``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from ..engines import probe
from .replica import Replica, ReplicaState

if TYPE_CHECKING:
    from ..metrics import Metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthSettings:
    interval: float = 2.0
    timeout: float = 2.0
    failures_to_down: int = 2
    successes_to_up: int = 1
    passive_failures_to_down: int = 3
    path: str = "/health"


class HealthTracker:
    """Turns probe and request outcomes into replica states."""

    def __init__(self, settings: HealthSettings, metrics: Metrics | None = None):
        self.settings = settings
        self.metrics = metrics
        self._probe_failures: dict[Replica, int] = {}
        self._probe_successes: dict[Replica, int] = {}
        self._passively_down: set[Replica] = set()  # down on request failures, not (yet) on a failed probe
        self._wakeups: dict[Replica, trio.Event] = {}  # set to probe a replica now instead of after the interval

    def set_state(self, replica: Replica, state: ReplicaState, reason: str) -> None:
        if replica.state is state:
            replica.reason = reason
            return
        first_up = replica.state is ReplicaState.UNKNOWN and state is ReplicaState.UP  # expected: no news
        level = logging.WARNING if state is ReplicaState.DOWN else logging.DEBUG if first_up else logging.INFO
        log.log(level, "replica %s (%s) is now %s: %s", replica.name, replica.url, state.value, reason)
        replica.state = state
        replica.reason = reason
        if self.metrics is not None:
            self.metrics.for_replica(replica).up.set(1 if state.routable else 0)

    def probe_result(self, replica: Replica, ok: bool, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.health_probes.labels(replica.model, replica.name, "ok" if ok else "fail").inc()
        if replica.state is ReplicaState.DRAINING:
            return
        if ok:
            self._probe_failures[replica] = 0
            successes = self._probe_successes.get(replica, 0) + 1
            self._probe_successes[replica] = successes
            if replica in self._passively_down:
                self._passively_down.discard(replica)
                replica.consecutive_failures = 0
                self.set_state(replica, ReplicaState.UP, "health probe passed after request failures")
            elif replica.state is not ReplicaState.UP and successes >= self.settings.successes_to_up:
                replica.consecutive_failures = 0
                self.set_state(replica, ReplicaState.UP, "health probe passed")
        else:
            self._passively_down.discard(replica)  # from now on it needs successes_to_up good probes
            self._probe_successes[replica] = 0
            failures = self._probe_failures.get(replica, 0) + 1
            self._probe_failures[replica] = failures
            if replica.state is not ReplicaState.DOWN and (
                    failures >= self.settings.failures_to_down or replica.state is ReplicaState.UNKNOWN):
                self.set_state(replica, ReplicaState.DOWN, f"health probe failed: {reason}")

    def request_failed(self, replica: Replica, reason: str) -> None:
        replica.consecutive_failures += 1
        if (replica.state.routable and replica.consecutive_failures >= self.settings.passive_failures_to_down):
            self.set_state(replica, ReplicaState.DOWN,
                           f"{replica.consecutive_failures} requests failed in a row, last: {reason}")
            self._probe_successes[replica] = 0
            self._passively_down.add(replica)
            wakeup = self._wakeups.get(replica)
            if wakeup is not None:
                wakeup.set()

    def request_succeeded(self, replica: Replica) -> None:
        replica.consecutive_failures = 0

    def forget(self, replica: Replica) -> None:
        self._probe_failures.pop(replica, None)
        self._probe_successes.pop(replica, None)
        self._passively_down.discard(replica)
        self._wakeups.pop(replica, None)

    async def wait_for_next_probe(self, replica: Replica) -> None:
        """Sleep one interval, or less when request failures took ``replica`` down meanwhile."""
        wakeup = self._wakeups[replica] = trio.Event()
        with trio.move_on_after(self.settings.interval):
            await wakeup.wait()


async def probe_once(replica: Replica, settings: HealthSettings) -> tuple[bool | None, str]:
    """One ``GET /health`` through the replica's connection pool; (ok, reason); ok is None when the probe could not
    be sent (this process is out of descriptors): it tells nothing either way."""
    assert replica.pool is not None
    headers = [replica.auth_header] if replica.auth_header else []
    health = await probe.check_health(replica.pool, replica.base_path + settings.path, settings.timeout, headers)
    if health.inconclusive:
        return None, health.reason
    return health.ok, "ok" if health.ok else health.reason


async def probe_forever(replica: Replica, tracker: HealthTracker) -> None:
    """Probe ``replica`` every interval until cancelled."""
    settings = tracker.settings
    while True:
        ok, reason = await probe_once(replica, settings)
        if ok is not None:
            tracker.probe_result(replica, ok, reason)
        await tracker.wait_for_next_probe(replica)
