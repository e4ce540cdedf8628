"""The faults ``llmgw bench chaos`` knows, in the order it runs them, and when a soak runs which.

A fault is named here with what it does and how long it lasts; :mod:`.chaos` does it. :func:`parse_faults`
reads ``--faults``, :func:`soak_plan` spreads the schedule over a soak (one fault every ``every`` seconds,
round the schedule again and again), and :func:`slope_per_hour` is how the soak reports a resource's drift.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Fault:
    name: str
    what: str  # the table's words for it
    victim: str | None = None  # "leader", "gateway": a process whose own in-flight requests are counted apart


SCHEDULE: tuple[Fault, ...] = (
    Fault("redis-stop", "Redis SIGSTOP {redis_stop:g} s, then SIGCONT"),
    Fault("redis-restart", "Redis kill -9, restarted empty {redis_down:g} s later"),
    Fault("leader-stop", "the leader SIGSTOP {leader_stop:g} s, then SIGCONT", victim="leader"),
    Fault("leader-kill", "the leader kill -9, restarted as a candidate", victim="leader"),
    Fault("forged-lease", 'SET llmgw:CLUSTER:leader "999 evil http://127.0.0.1:1" PX {forged_ms}, no secret'),
    Fault("lease-delete", "DEL llmgw:CLUSTER:leader {lease_deletes} times, 1 s apart"),
    Fault("partition", "the last gateway cut from Redis {partition:g} s (a TCP proxy), then restored"),
    Fault("agent-kill", "the agent kill -9, started again {agent_down:g} s later"),
    Fault("engine-kill", "one engine of the fixed deployment kill -9 (its agent restarts it)"),
    Fault("autoscaled-engine-kill", "the autoscaled deployment's only engine kill -9 (its agent restarts it)"),
)
BY_NAME = {fault.name: fault for fault in SCHEDULE}
QUICK = ("partition",)


def parse_faults(text: str | None) -> list[Fault]:
    """``--faults a,b`` (in the order given; ``all`` or nothing: the whole schedule); ValueError naming the
    unknown ones."""
    if not text or text == "all":
        return list(SCHEDULE)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in BY_NAME]
    if unknown or not names:
        raise ValueError(f"unknown fault(s) {', '.join(unknown) or '(none given)'}; known: "
                         f"{', '.join(BY_NAME)}")
    return [BY_NAME[name] for name in names]


def soak_plan(minutes: float, every: float, faults: Sequence[Fault]) -> list[tuple[float, Fault]]:
    """``(seconds from the soak's start, fault)`` for each fault of a soak of ``minutes``: the first after
    ``every`` seconds, then one every ``every`` seconds, going round ``faults``; none in the last ``every``
    (the soak ends with a quiet stretch, so the last fault's recovery is measured whole)."""
    if every <= 0 or not faults:
        return []
    total = minutes * 60
    plan: list[tuple[float, Fault]] = []
    at = every
    while at + every <= total + 1e-9:
        plan.append((at, faults[len(plan) % len(faults)]))
        at += every
    return plan


def slope_per_hour(points: Sequence[tuple[float, float]]) -> float | None:
    """The least-squares slope of ``(seconds, value)`` points, per hour; None with fewer than 2 distinct times."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_v = sum(v for _, v in points) / n
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread == 0:
        return None
    return sum((t - mean_t) * (v - mean_v) for t, v in points) / spread * 3600


def median_and_range(values: Sequence[float]) -> tuple[float, float, float] | None:
    """``(median, min, max)`` of ``values``; None when there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    middle = len(ordered) // 2
    median = ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return median, ordered[0], ordered[-1]
