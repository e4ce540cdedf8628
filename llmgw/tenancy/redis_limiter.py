"""The limiter of a cluster: N gateways x W workers admit as one, each from its leased shares of every limit.

Every limit lives in Redis (:mod:`.lease_script`); each process admits from its own share of it
(:mod:`.leases`), so a request waits on Redis only when its process's share cannot cover it: a key's first
request, a burst larger than the share, a demand that grew. Such requests wait for one call, which all the
requests lacking something at that moment share (one batch, over every key and team); a request a budget still
lacks then, while the budget's use leaves room for it, waits a while longer for what other processes' shares and
requests in flight hold (:meth:`RedisLimiter._wait_for_more`). One task makes every
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
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Iterable

import trio

from ..cluster.link import RedisLink, Unavailable
from ..cluster.records import Keys
from .admission import BUDGETS, Pool, Slot, Subject, short_of
from .interfaces import Admission, Refusal
from .lease_script import CALL_MEMORY_MS, LEASE, SEED, Operation, Unseeded, calls_key, decode, encode
from .leases import LeasedPool, budget_expiry_ms, budget_key, pool_key, used_key
from .limiter_metrics import LimiterMetrics
from .model import Estimate, TenancySettings, Tenant
from .pool_limiter import Clock, PoolLimiter, Spent
from .pools import period_start

if TYPE_CHECKING:
    from ..cluster.state import SharedState

log = logging.getLogger(__name__)

LIVE_MEMORY = 10.0  # seconds: a process whose load report lapsed a moment ago still counts as live
HOLDER_TTL = 5.0  # seconds: a process's slots and budget shares outlive its last heartbeat by this much at most
ANSWERED, RESEEDED, FAILED = "answered", "reseeded", "failed"  # what became of a lease call
RETRY_FOR = CALL_MEMORY_MS / 1000 / 2  # seconds: a call whose answer was lost is retried as is for this long


def tenancy_prefix(cluster: str) -> str:
    """Where the limits of ``cluster`` live in Redis."""
    return Keys(cluster).prefix + "tenancy:"


def holder_name(origin: str) -> str:
    """This process's name as a holder of concurrency slots and budget shares: new at every start."""
    return f"{origin}:{os.getpid()}:{secrets.token_hex(4)}"


@dataclass(slots=True)
class LeaseCall:
    """One call of the lease script as sent: sent again as is (its id too) when its answer was lost."""

    call_id: int
    keys: list[str]
    args: list[Any]
    batch: list[tuple[LeasedPool, Operation, int]]  # each pool, its operation, what its waiters had asked
    kind: str
    first_sent: float
    lost: bool = False  # its answer was lost at least once: an answer now is the first one, late


class RedisLimiter(PoolLimiter):
    """Admits from this process's leased shares of every limit; :meth:`run` makes the lease calls."""

    def __init__(self, settings: TenancySettings, link: RedisLink, cluster: str, origin: str, *,
                 clock: Clock = time.time, metrics: LimiterMetrics | None = None,
                 live_processes: Callable[[], int] = lambda: 1, holder_ttl: float = HOLDER_TTL,
                 spent: Callable[[], Awaitable[Iterable[Spent]]] | None = None):
        super().__init__(settings, clock, metrics)
        self.link = link
        self.live_processes = live_processes
        self.prefix = tenancy_prefix(cluster)
        self.holder = holder_name(origin)
        self.holder_ttl_ms = int(holder_ttl * 1000)
        self.calls_key = calls_key(self.prefix, self.holder)
        self._call_ids = 0
        self._lost: LeaseCall | None = None  # the last call, when Redis may have run it but its answer was lost
        self.degraded = False
        self.live = 1  # the most live processes seen in the last LIVE_MEMORY seconds Redis answered
        self._live_seen: deque[tuple[float, int]] = deque()
        self._pending: set[LeasedPool] = set()
        self._giving: set[LeasedPool] = set()
        self._wake = trio.Event()
        self._round = trio.Event()  # set when the call that takes the pools pending now has answered
        self._probe = False
        self._closing = False
        self._spent = spent
        self._seeds: list[Spent] = []
        self._reseed = spent is not None
        self._seeding = spent is not None  # leases wait for the seeds (:meth:`seed`, ``spent``) to be in Redis
        self.marker = self.prefix + "seeded"
        self.tick = min(0.5, holder_ttl / 3, settings.lease_idle_seconds / 2)

    @property
    def lease_seconds(self) -> float:
        return self.settings.lease_seconds

    @property
    def lease_idle_seconds(self) -> float:
        return self.settings.lease_idle_seconds

    @property
    def budgets_fail_closed(self) -> bool:
        return self.settings.budgets_fail_closed

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
        """A limit's share of this process while Redis is away: the limit divided by the live processes (as
        counted before it went away: the peers' load reports, which come through Redis, stop with it)."""
        return max(1, capacity // self.live)

    def _count_live(self, now: float) -> None:
        seen = self._live_seen
        seen.append((now, max(1, self.live_processes())))
        while seen and seen[0][0] < now - LIVE_MEMORY:
            seen.popleft()
        self.live = max(count for _, count in seen)

    # -- the hot path --

    async def admit(self, tenant: Tenant, model: str, estimate: Estimate) -> Admission | Refusal:
        await trio.lowlevel.checkpoint_if_cancelled()
        now = self.clock()
        slots, needs = self._needs(tenant, estimate, now)
        short = short_of(needs, now)
        if short and not self.degraded and all(amount <= slot.pool.capacity for slot, amount in short):
            self.metrics.lease_waits.inc()
            self._ask(short, now)
            self._wake.set()
            await self._next_round(trio.current_time() + self.link.settings.timeout + 0.5)
            now = self.clock()
            short = short_of(needs, now)
            if short and all(worth_waiting(slot, amount, now) for slot, amount in short):
                await self._wait_for_more(needs, short)
                now = self.clock()
        return self._decide(tenant, slots, needs, now)

    def _ask(self, short: list[tuple[Slot, int]], now: float) -> None:
        for slot, amount in short:
            pool = slot.pool
            assert isinstance(pool, LeasedPool)
            pool.ask(math.ceil(amount - pool.room(now)))
            self._pending.add(pool)

    async def _next_round(self, deadline: float) -> bool:
        """Wait for the call that takes the asks made so far; False if ``deadline`` came first."""
        answered = self._round
        with trio.move_on_at(deadline):
            await answered.wait()
            return True
        return False

    async def _wait_for_more(self, needs: list[tuple[Slot, int]], short: list[tuple[Slot, int]]) -> None:
        """Still short after a lease call, of what Redis had at its answer (another request of this process
        reserved the grant before this one ran: ask again at once), or of what a budget's use so far leaves (the
        rest is held by leases of other processes, given back within ``lease_idle_seconds`` when idle, or by
        requests in flight: ask again at each upkeep tick, no call storm). Until covered, or for
        ``lease_idle_seconds`` and a lease call's timeout at most (then the refusal says retry shortly)."""
        if any(held_back(slot, amount, self.clock()) for slot, amount in short):
            self.metrics.budget_waits.inc()
        deadline = trio.current_time() + self.settings.lease_idle_seconds + self.link.settings.timeout + 0.5
        while short and not self.degraded:
            now = self.clock()
            self._ask(short, now)
            if all(leasable(slot, amount, now) for slot, amount in short):
                self._wake.set()
            if not await self._next_round(deadline):
                return
            now = self.clock()
            short = short_of(needs, now)
            if not all(worth_waiting(slot, amount, now) for slot, amount in short):
                return

    # -- the background --

    def seed(self, spent: Iterable[Spent]) -> None:
        """Raise each budget's counter in Redis to at least what the usage store says was spent in its current
        period (as :meth:`.LocalLimiter.seed`; a Redis without persistence, or restarted, forgot it): applied at
        the next call, and again whenever Redis answers after an outage."""
        self._seeds = [row for row in spent if row.tokens > 0 or row.nano_usd > 0]
        self._reseed = self._seeding = True
        self._wake.set()

    async def _apply_seeds(self) -> None:
        if self._spent is not None:
            try:
                with trio.fail_after(self.link.settings.timeout):
                    self._seeds = [row for row in await self._spent() if row.tokens > 0 or row.nano_usd > 0]
            except Exception as exc:  # the usage store's own failure, or too slow: seed what was read before
                log.error("tenant limits: the budgets' spend could not be read from the usage store (%s: %s); "
                          "seeding what was read before", type(exc).__name__, exc)
        now = self.clock()
        keys: list[str] = [self.marker]
        args: list[int] = []
        for row in self._seeds:
            for dimension, amount in (("budget_tokens", row.tokens), ("budget_usd", row.nano_usd)):
                if amount > 0:
                    base = pool_key(self.prefix, row.kind, row.name, dimension)
                    key = budget_key(base, row.period, period_start(row.period, now))
                    for counter in (key, used_key(key)):
                        keys.append(counter)
                        args += [min(amount, 1 << 53), budget_expiry_ms(row.period, now)]
        self._reseed = False
        try:
            await self.link.call("tenancy_seed", lambda client: client.eval(SEED, keys=keys, args=args))
        except Unavailable as exc:
            self._reseed = True
            self._set_degraded(str(exc))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Make the lease calls and keep the shares until cancelled; then give back what is held. The budgets'
        seeds are applied before it reports started (within ``state.timeout``)."""
        with trio.move_on_after(self.link.settings.timeout):
            if self._reseed:
                await self._apply_seeds()
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
            if self.degraded and (probe or pools or giving):
                await self._ping()  # nothing is leased before the seeds are back (Redis may return empty)
            if self._reseed and not self.degraded:
                await self._apply_seeds()
            if self.degraded:
                for pool in pools:
                    pool.forget_asks()
            elif pools or giving or self._lost is not None:  # a lost call is sent again even if nothing else is
                await self._call(pools | giving, giving, "take" if pools - giving else "upkeep")
            answered.set()

    async def _upkeep(self) -> None:
        """Every tick: give back idle shares, renew the slots held, charge debts, count the live processes;
        while degraded, ask Redis whether it is back."""
        while True:
            await trio.sleep(self.tick)
            now = self.clock()
            if not self.degraded:
                self._count_live(trio.current_time())
            if not self.link.healthy and (self._seeds or self._spent is not None):
                self._reseed = True  # any call on the link failed: Redis may come back empty
            for pool in self._pools():
                if pool.idle(now, self.settings.lease_idle_seconds):
                    self._giving.add(pool)
                elif pool.owes():
                    self._pending.add(pool)
            self._probe = self.degraded
            self._wake.set()

    async def _call(self, pools: set[LeasedPool], giving: set[LeasedPool], kind: str, again: bool = True) -> None:
        if self._lost is not None and await self._send(self._lost) != ANSWERED:
            for pool in pools:
                pool.forget_asks()
            return
        now = self.clock()
        batch = []
        for pool in pools:
            asked = pool.asked
            operation = pool.operation(now, idle=pool in giving and not asked)
            if operation is not None:
                batch.append((pool, operation, asked))
        if not batch:
            return
        self._call_ids += 1
        keys, args = encode([operation for _, operation, _ in batch], self.marker, self._seeding, self.holder,
                            self.calls_key, self._call_ids)
        sent = await self._send(LeaseCall(self._call_ids, keys, args, batch, kind, trio.current_time()))
        if sent == RESEEDED and again and not self.degraded:
            await self._call(pools, giving, kind, again=False)

    async def _send(self, call: LeaseCall) -> str:
        """Make ``call``: :data:`ANSWERED`, :data:`RESEEDED` (Redis had lost the budgets' seeds: they are back,
        nothing was applied, ask again) or :data:`FAILED`. A call Redis may have run without its answer coming back is
        kept (:attr:`_lost`) and sent again, with its id, before any other: the script answers a repeat with its
        first answer, so nothing is counted twice. One that failed for good (a reply not the script's, or lost for
        longer than Redis remembers answers) gives back to its pools what it gave and charged."""
        operations = [operation for _, operation, _ in call.batch]
        started = trio.current_time()
        self._lost = None
        try:
            reply = await self.link.call("tenancy_lease", lambda client: client.eval(LEASE, keys=call.keys,
                                                                                     args=call.args))
            answers = decode(reply, operations)
        except Unseeded:
            self._unanswered(call, asked=False)
            log.warning("tenant limits: Redis lost the budgets' spend (restarted without persistence?): seeding "
                        "it again from the usage store before leasing")
            await self._apply_seeds()
            return RESEEDED
        except Unavailable as exc:  # Redis away or too slow: it may have run the call
            self.metrics.lease_calls.labels(call.kind, "failed").inc()
            if started - call.first_sent < RETRY_FOR:
                self._lost = call
                call.lost = True
            else:
                log.warning("tenant limits: a lease call unanswered for %.0f s is given up; what it reported is "
                            "reported again (counted twice if Redis ran it)", started - call.first_sent)
                self._unanswered(call, asked=True)
            self._set_degraded(str(exc))
            return FAILED
        except (ValueError, TypeError) as exc:  # an answer not the script's: Redis holds something it did not write
            self.metrics.lease_calls.labels(call.kind, "failed").inc()
            self._unanswered(call, asked=True)
            self._set_degraded(f"{type(exc).__name__}: {exc}")
            return FAILED
        self.metrics.lease_calls.labels(call.kind, "ok").inc()
        self.metrics.lease_seconds.observe(trio.current_time() - started)
        now = self.clock()
        for (pool, operation, asked), answer in zip(call.batch, answers):
            pool.answered(answer, asked, now, operation, late=call.lost)
            if answer.dropped:
                self.metrics.lapsed_holders.labels(pool.dimension).inc(answer.dropped)
                log.warning("tenant limits: %d process(es) holding %s stopped renewing it for %.0f s (killed, or cut "
                            "off from Redis): what they held went back", answer.dropped, operation.keys[0],
                            self.holder_ttl_ms / 1000)
        self._set_healthy()
        return ANSWERED

    @staticmethod
    def _unanswered(call: LeaseCall, asked: bool) -> None:
        for pool, operation, waiting in call.batch:
            pool.unanswered(operation, waiting if asked else 0)

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
        self._count_live(trio.current_time())
        for pool in self._pools():
            pool.fallback = None  # built afresh at the live processes' count of now
        budgets = ("admit only what this process's leases still hold" if self.budgets_fail_closed else
                   "are NOT enforced (tenancy.budgets_fail_closed is false); the spend is charged when it is back")
        log.warning("tenant limits degraded: Redis failed (%s); rate limits fall back to each limit divided by "
                    "the %d live processes, budgets %s", why, self.live, budgets)

    def _set_healthy(self) -> None:
        if self.degraded:
            self.degraded = False
            self._reseed = bool(self._seeds) or self._spent is not None  # Redis may have restarted empty
            self._wake.set()
            self.metrics.degraded.set(0)
            log.info("tenant limits: Redis answers again; limits are shared across the cluster again")


def held_back(slot: Slot, amount: int, now: float) -> bool:
    """A budget lacks ``amount`` but its use so far does not: leases or requests in flight hold the rest."""
    return slot.dimension in BUDGETS and not slot.pool.exhausted(amount, now)


def leasable(slot: Slot, amount: int, now: float) -> bool:
    """What this process holds and what Redis had left at its last answer cover ``amount``."""
    pool = slot.pool
    assert isinstance(pool, LeasedPool)
    return pool.room(now) + pool.left_now(now) >= amount


def worth_waiting(slot: Slot, amount: int, now: float) -> bool:
    return held_back(slot, amount, now) or leasable(slot, amount, now)


def cluster_limiter(shared: "SharedState", settings: TenancySettings, metrics: LimiterMetrics,
                    spent: Callable[[], Awaitable[Iterable[Spent]]] | None = None) -> RedisLimiter:
    """The limiter of a gateway that shares its state through Redis (a cluster, or ``--workers``): on its link,
    under its cluster's keys, counting as live processes the peers whose load reports it reads, and itself;
    ``spent``: the usage store's sums of the budgets' current periods (:meth:`RedisLimiter.seed`), read at start
    and whenever Redis lost them. Start its :meth:`~RedisLimiter.run` while the link runs, and stop it first: it
    gives its shares back."""
    return RedisLimiter(settings, shared.link, shared.settings.cluster, shared.origin, metrics=metrics,
                        live_processes=lambda: len(shared.load.peers) + 1, spent=spent)
