"""The limiter of one process (``state.backend: local``, one worker): exact, nothing shared, nothing awaited.

Each key and each team with limits gets its pools (:mod:`.pools`) the first time one of its requests comes,
built from its limits and resized when they change (a reload, ``PATCH /admin/keys``): rpm and tpm as token
buckets, concurrency as slots, each budget as a counter of its UTC period. A request is admitted when every pool
of its key and its team covers it, and then reserved in all of them at once (:mod:`.admission`).

Budget spend must survive a restart: the gateway seeds it at start from the usage store (:meth:`seed`, with
:func:`.pools.period_start` telling from when to sum).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import trio

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
from .pools import PeriodBudget, Slots, TokenBucket

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


class LocalLimiter:
    def __init__(self, settings: TenancySettings, clock: Clock = time.time, metrics: LimiterMetrics | None = None):
        self.settings = settings
        self.clock = clock
        self.metrics = metrics or LimiterMetrics()
        self._seeds: dict[tuple[str, str, str, str], int] = {}
        self.book = PoolBook(self._make_pool)

    def _make_pool(self, subject: Subject, dimension: str, period: str | None, capacity: int, now: float) -> Pool:
        if dimension in (REQUESTS, TOKENS):
            return TokenBucket(capacity, now)
        if dimension == CONCURRENCY:
            return Slots(capacity, now)
        assert period is not None
        budget = PeriodBudget(capacity, now, period)
        budget.seed(self._seeds.pop((subject.kind, subject.name, period, dimension), 0), now)
        return budget

    def seed(self, spent: Iterable[Spent]) -> None:
        """Count what was spent in each budget's current period before this start (from the usage store)."""
        now = self.clock()
        pools = {(s.subject.kind, s.subject.name, s.period, s.dimension): s.pool for s in self.book.all_slots()}
        for row in spent:
            for dimension, amount in ((BUDGET_TOKENS, row.tokens), (BUDGET_USD, row.nano_usd)):
                where = (row.kind, row.name, row.period, dimension)
                pool = pools.get(where)
                if isinstance(pool, PeriodBudget):
                    pool.seed(amount, now)
                else:
                    self._seeds[where] = self._seeds.get(where, 0) + max(0, amount)

    async def admit(self, tenant: Tenant, model: str, estimate: Estimate) -> Admission | Refusal:
        await trio.lowlevel.checkpoint_if_cancelled()
        return self.admit_now(tenant, estimate)

    def admit_now(self, tenant: Tenant, estimate: Estimate) -> Admission | Refusal:
        """:meth:`admit` without its checkpoint: reserve now, or refuse."""
        subjects = subjects_of(tenant)
        if not subjects:
            return UNLIMITED
        now = self.clock()
        slots = [slot for subject, limits in subjects for slot in self.book.slots(subject, limits, now)]
        needs = needs_of(slots, estimate, self.settings)
        short = short_of(needs, now)
        if short:
            return refusal(slots, short, now, self.metrics, team_label(tenant))
        reservations = reserve(needs, now)
        self.metrics.admitted.labels(team_label(tenant)).inc()
        return Settlement(headers_of(slots, now), reservations, self.settings, self.clock)
