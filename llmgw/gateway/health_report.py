"""Whether this process's view of its cluster can be trusted now, and why not: ``/health``'s ``status`` and
``reasons``, ``/ready``'s cluster reasons, a gauge per reason, and one log line per transition.

Three reasons make a gateway of a shared-state cluster ``degraded`` (each with the wall-clock time since it
holds):

- ``redis_unreachable``: Redis does not answer; routing goes on with the last known table, index and load;
- ``no_leader``: no process holds the cluster's lease (an election is under way, or Redis is away): nothing
  places replicas or publishes the table;
- ``state_not_loaded``: this process follows the cluster and has not loaded its state yet (it knows no
  deployed replica).

``/health`` stays 200 while degraded: it is liveness, and a liveness probe that killed a gateway whose Redis is
down would restart the one process still routing on its last known state (fail-static) into a cold start that
knows nothing. Readiness (``/ready``) is what takes a gateway out of a load balancer.

The state is evaluated when asked (``/health``, ``/ready``) and by :meth:`HealthReport.watch`, which wakes at
every Redis transition and every ``state.lease_renew``, so the log says when a transition happens even when no
one polls: a WARNING naming the reasons when the process becomes degraded (or its reasons change), an INFO when
it is ``ok`` again, never one per poll.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import trio
from prometheus_client import CollectorRegistry, Gauge

if TYPE_CHECKING:
    from ..cluster.state import SharedState

log = logging.getLogger(__name__)

REDIS_UNREACHABLE = "redis_unreachable"
NO_LEADER = "no_leader"
STATE_NOT_LOADED = "state_not_loaded"
REASONS = (REDIS_UNREACHABLE, NO_LEADER, STATE_NOT_LOADED)
BRIEF = {  # a reason in words that name no address: for the data port, whose callers are clients
    REDIS_UNREACHABLE: "the cluster's shared state is degraded: Redis is unreachable",
    NO_LEADER: "the cluster has no leader",
    STATE_NOT_LOADED: "this process has not loaded the cluster's shared state yet",
}
OK = "ok"
DEGRADED = "degraded"


def utc(stamp: float) -> str:
    """``2026-12-07T08:01:02Z``."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(stamp))


@dataclass(frozen=True)
class Reason:
    """One cause of ``degraded``: its code (one of :data:`REASONS`), the words, and since when it holds."""

    code: str
    message: str
    since: float  # wall clock

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "since": utc(self.since)}

    def sentence(self, detailed: bool = True) -> str:
        return f"{self.message if detailed else BRIEF[self.code]} (since {utc(self.since)})"


class HealthReport:
    """The degraded reasons of one process's shared state (none without one), tracked across calls."""

    def __init__(self, shared: "SharedState | None", registry: CollectorRegistry | None,
                 clock: Callable[[], float] = time.time):
        self.shared = shared
        self.clock = clock
        self._since: dict[str, float] = {}
        self._codes: tuple[str, ...] = ()
        self._degraded_at = 0.0
        self.gauge = Gauge("llmgw_health_degraded", "1 while this process is degraded for this reason "
                           "(redis_unreachable, no_leader, state_not_loaded; /health says why and since when), "
                           "else 0.", ["reason"], registry=registry)
        for code in REASONS:
            self.gauge.labels(code).set(0)

    def reasons(self) -> list[Reason]:
        """What holds now, each with the time it started; logs the transition if this is one."""
        shared = self.shared
        if shared is None:
            return []
        found: dict[str, str] = {}
        if not shared.link.healthy:
            found[REDIS_UNREACHABLE] = (f"shared state degraded: Redis at {shared.link.address} is unreachable "
                                        f"({shared.link.reason}); routing goes on with the last known state")
        if shared.leader_holder is None:
            found[NO_LEADER] = ("no leader: no process holds the cluster's lease (an election is under way, or "
                                "Redis is unreachable); nothing places replicas or publishes the table")
        if not shared.leading and not shared.follower.loaded.is_set():
            found[STATE_NOT_LOADED] = ("this process follows the cluster and has not loaded its state yet: it "
                                       "knows no deployed replica")
        now = self.clock()
        for code in list(self._since):
            if code not in found:
                del self._since[code]
        reasons = [Reason(code, message, self._since.setdefault(code, now)) for code, message in found.items()]
        self._transition(reasons, now)
        return reasons

    def to_json(self) -> dict[str, Any]:
        """``status`` (``ok`` or ``degraded``) and ``reasons`` (each ``code``, ``message``, ``since``)."""
        reasons = self.reasons()
        return {"status": DEGRADED if reasons else OK, "reasons": [reason.to_json() for reason in reasons]}

    def sentences(self, detailed: bool = True) -> list[str]:
        """The reasons in words, for ``/ready``; not ``detailed``: without Redis's address or error (the data
        port's, whose callers are clients; the control port's ``/health`` has the details)."""
        return [reason.sentence(detailed) for reason in self.reasons()]

    async def watch(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Evaluate at every Redis transition and every ``lease_renew``, so that each transition is logged when
        it happens; until cancelled."""
        task_status.started()
        shared = self.shared
        if shared is None:
            return
        every = shared.settings.lease_renew
        while True:
            self.reasons()
            changed = shared.link.changed  # replaced at every transition: take this one before waiting
            with trio.move_on_after(every):
                await changed.wait()

    def _transition(self, reasons: list[Reason], now: float) -> None:
        codes = tuple(reason.code for reason in reasons)
        if codes == self._codes:
            return
        before, self._codes = self._codes, codes
        for code in REASONS:
            self.gauge.labels(code).set(code in codes)
        if not codes:
            log.info("health: ok again after %.1fs degraded", now - self._degraded_at)
            return
        if not before:
            self._degraded_at = now
        log.warning("health: %s: %s", "degraded" if not before else "still degraded, now",
                    "; ".join(reason.message for reason in reasons))
