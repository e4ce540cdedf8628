"""The limiter of a cluster: N gateways x W workers admit as one, each from its leased shares of every limit.

Every limit lives in Redis (:mod:`.lease_script`); each process admits from its own share of it
(:mod:`.leases`), so a request waits on Redis only when its process's share cannot cover it: a key's first
request, a burst larger than the share, a demand that grew. Such requests wait for one call, which all the
requests lacking something at that moment share (one batch, over every key and team). One task makes every
call (:meth:`RedisLimiter.run`, in the gateway's nursery), in order: refills ahead of need, give-backs of idle
shares, debts of answers that used more than they reserved, and the heartbeat of the concurrency slots held.

Exactness: every unit admitted anywhere was first taken from the pool in Redis, atomically, so the requests
admitted over all processes never exceed a limit (the bucket's capacity plus its refill), and tokens and money
overshoot only by what answers used beyond their reservations. Redis away: see :mod:`.leases`, and
docs/tenants.md "When Redis is away".
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import time
from typing import Callable, Iterable

import trio

from ..cluster.link import RedisLink, Unavailable
from ..cluster.records import Keys
from .admission import (
    Pool,
    Settlement,
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
from .lease_script import LEASE, decode, encode
from .leases import LeasedPool
from .limiter_metrics import LimiterMetrics
from .local_limiter import UNLIMITED, Clock, PoolBook
from .model import Estimate, TenancySettings, Tenant

log = logging.getLogger(__name__)

HOLDER_TTL = 5.0  # seconds: a process's concurrency slots outlive its last heartbeat by this much at most


def tenancy_prefix(cluster: str) -> str:
    """Where the limits of ``cluster`` live in Redis."""
    return Keys(cluster).prefix + "tenancy:"


def holder_name(origin: str) -> str:
    """This process's name as a holder of concurrency slots: new at every start."""
    return f"{origin}:{os.getpid()}:{secrets.token_hex(4)}"


class RedisLimiter:
    def __init__(self, settings: TenancySettings, link: RedisLink, cluster: str, origin: str, *,
                 clock: Clock = time.time, metrics: LimiterMetrics | None = None,
                 live_processes: Callable[[], int] = lambda: 1, holder_ttl: float = HOLDER_TTL):
        self.settings = settings
        self.link = link
        self.clock = clock
        self.metrics = metrics or LimiterMetrics()
        self.live_processes = live_processes
        self.prefix = tenancy_prefix(cluster)
        self.holder = holder_name(origin)
        self.holder_ttl_ms = int(holder_ttl * 1000)
        self.lease_seconds = settings.lease_seconds
        self.budgets_fail_closed = settings.budgets_fail_closed
        self.degraded = False
        self.book = PoolBook(self._make_pool)
        self._pending: set[LeasedPool] = set()
        self._giving: set[LeasedPool] = set()
        self._wake = trio.Event()
        self._round = trio.Event()  # set when the call that takes the pools pending now has answered
        self._probe = False
        self._closing = False
        self.tick = min(0.5, holder_ttl / 3, settings.lease_idle_seconds / 2)

    def _make_pool(self, subject: Subject, dimension: str, period: str | None, capacity: int, now: float) -> Pool:
        return LeasedPool(self, self.prefix, subject, dimension, period, capacity, now)

    def _pools(self) -> Iterable[LeasedPool]:
        for slot in self.book.all_slots():
            assert isinstance(slot.pool, LeasedPool)
            yield slot.pool

    # -- what pools ask --

    def refill_soon(self, pool: LeasedPool) -> None:
        self._pending.add(pool)
        self._wake.set()

    def give_soon(self, pool: LeasedPool) -> None:
        self._giving.add(pool)
        self._wake.set()

    def fallback_capacity(self, capacity: int) -> int:
        """A limit's share of this process while Redis is away: the limit divided by the live processes."""
        return max(1, capacity // max(1, self.live_processes()))

    # -- the hot path --

    async def admit(self, tenant: Tenant, model: str, estimate: Estimate) -> Admission | Refusal:
        await trio.lowlevel.checkpoint_if_cancelled()
        subjects = subjects_of(tenant)
        if not subjects:
            return UNLIMITED
        now = self.clock()
        slots = [slot for subject, limits in subjects for slot in self.book.slots(subject, limits, now)]
        needs = needs_of(slots, estimate, self.settings)
        short = short_of(needs, now)
        if short and not self.degraded and all(amount <= slot.pool.capacity for slot, amount in short):
            self.metrics.lease_waits.inc()
            for slot, amount in short:
                pool = slot.pool
                assert isinstance(pool, LeasedPool)
                pool.ask(math.ceil(amount - pool.room(now)))
                self._pending.add(pool)
            answered = self._round
            self._wake.set()
            with trio.move_on_after(self.link.settings.timeout + 0.5):
                await answered.wait()
            now = self.clock()
            short = short_of(needs, now)
        if short:
            return refusal(slots, short, now, self.metrics, team_label(tenant))
        reservations = reserve(needs, now)
        self.metrics.admitted.labels(team_label(tenant)).inc()
        return Settlement(headers_of(slots, now), reservations, self.settings, self.clock)

    # -- the background --

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Make the lease calls and keep the shares until cancelled; then give back what is held."""
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._calls)
                nursery.start_soon(self._upkeep)
                task_status.started()
        finally:
            self._closing = True
            with trio.CancelScope(shield=True), trio.move_on_after(self.link.settings.timeout):
                if not self.degraded:
                    pools = set(self._pools())
                    await self._call(pools, pools, "release")

    async def _calls(self) -> None:
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            pools, self._pending = self._pending, set()
            giving, self._giving = self._giving, set()
            answered, self._round = self._round, trio.Event()
            probe, self._probe = self._probe, False
            if pools or giving:
                await self._call(pools | giving, giving, "take" if pools - giving else "upkeep")
            elif probe:
                await self._ping()
            answered.set()

    async def _upkeep(self) -> None:
        """Every tick: give back idle shares, renew the slots held, charge debts; while degraded, ask Redis
        whether it is back and keep the fallback's shares to the live processes."""
        while True:
            await trio.sleep(self.tick)
            now = self.clock()
            for pool in self._pools():
                if self.degraded and pool.fallback is not None:
                    pool.fallback.resize(self.fallback_capacity(pool.capacity), now)
                if pool.idle(now, self.settings.lease_idle_seconds):
                    self._giving.add(pool)
                elif pool.held or pool.in_use:  # a debt to charge, a share to refill, slots to renew
                    self._pending.add(pool)
            self._probe = self.degraded
            self._wake.set()

    async def _call(self, pools: set[LeasedPool], giving: set[LeasedPool], kind: str) -> None:
        now = self.clock()
        batch = []
        for pool in pools:
            asked = pool.asked
            operation = pool.operation(now, idle=pool in giving and not asked)
            if operation is not None:
                batch.append((pool, operation, asked))
        if not batch:
            return
        operations = [operation for _, operation, _ in batch]
        keys, args = encode(operations)
        started = trio.current_time()
        try:
            reply = await self.link.call("tenancy_lease", lambda client: client.eval(LEASE, keys=keys, args=args))
            answers = decode(reply, operations)
        except (Unavailable, ValueError, TypeError) as exc:  # Redis away, or a reply not the script's
            self.metrics.lease_calls.labels(kind, "failed").inc()
            for pool, operation, asked in batch:
                pool.unanswered(operation, asked)
            self._set_degraded(f"{type(exc).__name__}: {exc}")
            return
        self.metrics.lease_calls.labels(kind, "ok").inc()
        self.metrics.lease_seconds.observe(trio.current_time() - started)
        now = self.clock()
        for (pool, _, asked), answer in zip(batch, answers):
            pool.answered(answer, asked, now)
        self._set_healthy()

    async def _ping(self) -> None:
        try:
            await self.link.call("tenancy_probe", lambda client: client.ping())
        except Unavailable as exc:
            self._set_degraded(str(exc))
            return
        self._set_healthy()

    def _set_degraded(self, why: str) -> None:
        if self.degraded or self._closing:
            return
        self.degraded = True
        self.metrics.degraded.set(1)
        for pool in self._pools():
            pool.fallback = None  # built afresh at the live processes' count of now
        budgets = ("admit only what this process's leases still hold" if self.budgets_fail_closed else
                   "are NOT enforced (tenancy.budgets_fail_closed is false); the spend is charged when it is back")
        log.warning("tenant limits degraded: Redis failed (%s); rate limits fall back to each limit divided by "
                    "the %d live processes, budgets %s", why, max(1, self.live_processes()), budgets)

    def _set_healthy(self) -> None:
        if self.degraded:
            self.degraded = False
            self.metrics.degraded.set(0)
            log.info("tenant limits: Redis answers again; limits are shared across the cluster again")
