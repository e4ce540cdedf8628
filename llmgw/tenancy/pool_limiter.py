"""What both limiters share: each key's and team's pools, built from their limits (:class:`PoolBook`), and
admitting a request against them (:class:`PoolLimiter`); the local one keeps its pools in memory
(:mod:`.local_limiter`), the cluster's leases them from Redis (:mod:`.redis_limiter`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from .admission import (
    BUDGET_TOKENS,
    BUDGET_USD,
    CONCURRENCY,
    REQUESTS,
    TOKENS,
    Pool,
    Settlement,
    Slot,
    Subject,
    headers_of,
    needs_of,
    refusal,
    reserve,
    short_of,
    subjects_of,
    team_label,
)
from .interfaces import Admission, Refusal
from .limiter_metrics import LimiterMetrics
from .model import Estimate, Limits, TenancySettings, Tenant, Usage

Clock = Callable[[], float]  # wall-clock seconds since the epoch (budgets follow the UTC calendar)
PoolFactory = Callable[[Subject, str, "str | None", int, float], Pool]


def limit_specs(limits: Limits) -> list[tuple[str, str | None, int]]:
    """``(dimension, period, capacity)`` of every pool ``limits`` asks for."""
    specs: list[tuple[str, str | None, int]] = []
    if limits.rpm is not None:
        specs.append((REQUESTS, None, limits.rpm))
    if limits.tpm is not None:
        specs.append((TOKENS, None, limits.tpm))
    if limits.concurrency is not None:
        specs.append((CONCURRENCY, None, limits.concurrency))
    for budget in limits.budgets:
        if budget.tokens is not None:
            specs.append((BUDGET_TOKENS, budget.period, budget.tokens))
        if budget.nano_usd is not None:
            specs.append((BUDGET_USD, budget.period, budget.nano_usd))
    return specs


class PoolBook:
    """Each subject's pools, made by ``make`` from its limits, and resized in place when the limits change."""

    def __init__(self, make: PoolFactory):
        self._make = make
        self._subjects: dict[tuple[str, str], tuple[Limits, list[Slot]]] = {}

    def slots(self, subject: Subject, limits: Limits, now: float) -> list[Slot]:
        entry = self._subjects.get((subject.kind, subject.name))
        if entry is not None and entry[0] == limits:
            return entry[1]
        old = {(slot.dimension, slot.period): slot.pool for slot in entry[1]} if entry is not None else {}
        slots = []
        for dimension, period, capacity in limit_specs(limits):
            pool = old.get((dimension, period))
            if pool is None:
                pool = self._make(subject, dimension, period, capacity, now)
            else:
                pool.resize(capacity, now)
            slots.append(Slot(subject, dimension, period, pool))
        self._subjects[(subject.kind, subject.name)] = (limits, slots)
        return slots

    def all_slots(self) -> Iterable[Slot]:
        for _, slots in self._subjects.values():
            yield from slots


@dataclass(frozen=True, slots=True)
class Spent:
    """What the usage store counts as spent by a key or a team in a budget's current period (:meth:`seed`)."""

    kind: str  # "key" (name: its key_id) or "team"
    name: str
    period: str  # day, month or total: summed since :func:`.pools.period_start` of it
    tokens: int  # as TenancySettings.counted_tokens counts them
    nano_usd: int


class Unlimited:
    """The admission of a key nothing limits: no headers, nothing to settle."""

    headers: list[tuple[bytes, bytes]] = []

    def settle(self, usage: Usage | None) -> None:
        return None


UNLIMITED = Unlimited()


class PoolLimiter:
    """A limiter over a :class:`PoolBook`: the subclass says how a pool is made (:meth:`_make_pool`)."""

    def __init__(self, settings: TenancySettings, clock: Clock, metrics: LimiterMetrics | None):
        self.settings = settings
        self.clock = clock
        self.metrics = metrics or LimiterMetrics()
        self.book = PoolBook(self._make_pool)

    def _make_pool(self, subject: Subject, dimension: str, period: str | None, capacity: int, now: float) -> Pool:
        raise NotImplementedError

    def _needs(self, tenant: Tenant, estimate: Estimate, now: float) -> tuple[list[Slot], list[tuple[Slot, int]]]:
        """Every pool of the tenant's key and team, and what the request needs of each (none: unlimited)."""
        slots = [slot for subject, limits in subjects_of(tenant) for slot in self.book.slots(subject, limits, now)]
        return slots, needs_of(slots, estimate, self.settings)

    def _decide(self, tenant: Tenant, slots: list[Slot], needs: list[tuple[Slot, int]],
                now: float) -> Admission | Refusal:
        """Reserve ``needs`` in every pool now, or refuse the request."""
        if not slots:
            return UNLIMITED
        short = short_of(needs, now)
        if short:
            return refusal(slots, short, now, self.metrics, team_label(tenant))
        reservations = reserve(needs, now)
        self.metrics.admitted.labels(team_label(tenant)).inc()
        return Settlement(headers_of(slots, now), reservations, self.settings, self.clock)
