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
from typing import Iterable

import trio

from .admission import BUDGET_TOKENS, BUDGET_USD, CONCURRENCY, REQUESTS, TOKENS, Pool, Subject
from .interfaces import Admission, Refusal
from .limiter_metrics import LimiterMetrics
from .model import Estimate, TenancySettings, Tenant
from .pool_limiter import Clock, PoolLimiter, Spent
from .pools import PeriodBudget, Slots, TokenBucket

__all__ = ["LocalLimiter", "Spent"]


class LocalLimiter(PoolLimiter):
    def __init__(self, settings: TenancySettings, clock: Clock = time.time, metrics: LimiterMetrics | None = None):
        self._seeds: dict[tuple[str, str, str, str], int] = {}
        super().__init__(settings, clock, metrics)

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
        now = self.clock()
        return self._decide(tenant, *self._needs(tenant, estimate, now), now)
