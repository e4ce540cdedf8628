"""One limit's share in this process: the part of a pool in Redis it leased, spent locally without waiting.

A :class:`LeasedPool` is the :class:`~.admission.Pool` a :class:`~.redis_limiter.RedisLimiter` admits against.
Its ``held`` is what the process took from Redis and has not reserved yet; a settle puts what an answer did not
use back into it (an answer that used more makes it negative: a debt, charged to Redis at the next call). It
learns the process's demand (an exponential average of what is reserved per second) and sizes each lease to
``lease_seconds`` of it, asking again in the background when less than half of that is left; what it holds
goes back after ``lease_idle_seconds`` without a request, or at shutdown.

While Redis is away (:attr:`Leases.degraded`), rate limits are this process's own buckets of the limit divided
by the live processes, and budgets admit only what the lease in hand holds (``budgets_fail_closed``), until
Redis drops this holder's record (its TTL after the last answered call: the lease may be another process's then),
or everything (the settled spend is charged when Redis is back).
"""

from __future__ import annotations

import math
from typing import Protocol
from urllib.parse import quote

from .admission import BUDGETS, CONCURRENCY, Subject
from .lease_script import BUCKET, BUDGET, SLOTS, Answer, Operation
from .pools import CONCURRENCY_RETRY, DAY, TokenBucket, period_end, period_start

WINDOW = 60.0  # rpm and tpm refill over a minute
FALLBACK = 1  # the stamp of a reservation in the fallback bucket (Redis away)
DEMAND_HALF_LIFE = 2.0  # seconds: how fast the demand estimate forgets


class Leases(Protocol):
    """What a pool asks of the limiter that owns it."""

    degraded: bool
    holder: str
    holder_ttl_ms: int
    live: int  # the live processes, as last counted

    @property
    def budgets_fail_closed(self) -> bool: ...

    @property
    def lease_seconds(self) -> float: ...

    @property
    def lease_idle_seconds(self) -> float: ...

    def refill_soon(self, pool: "LeasedPool") -> None: ...

    def give_soon(self, pool: "LeasedPool") -> None: ...

    def fallback_capacity(self, capacity: int) -> int: ...


def pool_key(prefix: str, kind: str, name: str, dimension: str) -> str:
    """The Redis key of a subject's pool (a budget's counter adds its period and the period's start)."""
    return f"{prefix}{kind}:{quote(name, safe='')}:{dimension}"


def budget_key(base: str, period: str, start: float) -> str:
    return f"{base}:{period}:{int(start)}"


def used_key(key: str) -> str:
    """Where a budget counter's used part is kept (:mod:`.lease_script`): the committed one less the leases."""
    return key + ":used"


def budget_keys(key: str) -> tuple[str, ...]:
    """A budget counter's keys in a lease call: committed, used, and what each holder holds of it (and until)."""
    return key, used_key(key), key + ":held", key + ":holders"


def budget_expiry_ms(period: str, now: float) -> int:
    """When a budget counter of the period holding ``now`` may go (Unix ms; 0: never): a day after it ends."""
    ends = period_end(period, now)
    return 0 if math.isinf(ends) else int((ends + DAY) * 1000)


def kind_of(dimension: str) -> str:
    if dimension == CONCURRENCY:
        return SLOTS
    return BUDGET if dimension in BUDGETS else BUCKET


class LeasedPool:
    """One limit of one key or team as this process holds it: its share, its demand, its fallback."""

    def __init__(self, owner: Leases, prefix: str, subject: Subject, dimension: str, period: str | None,
                 capacity: int, now: float):
        self.owner = owner
        self.kind = kind_of(dimension)
        self.dimension = dimension
        self.period = period
        self.capacity = capacity
        self._base = pool_key(prefix, subject.kind, subject.name, dimension)
        self.held = 0  # leased, not reserved; negative: a debt
        self.in_use = 0  # slots and budgets: reserved and not settled (a budget's: in its current period)
        self.asked = 0  # what waiting requests lack, for the next call
        self.least = 0  # what the waiting request that lacks least lacks (a grant of less serves none)
        self.left = float(capacity)  # what Redis said was left at its last answer
        self.unused = float(capacity)  # a budget: what Redis said its use leaves (leases and requests aside)
        self.consumed = 0  # a budget: what settled answers used, not yet reported to Redis
        self.starved = False  # a budget: the last call could not grant what waiting requests lacked
        self.renewed_at = -math.inf  # a budget: when the last call Redis answered was made (its holder's renewal)
        self._sent_at = -math.inf
        self.left_at = now
        self.demand = 0.0  # units reserved per second, decaying
        self.demand_at = now
        self.last_use = now
        self.start = period_start(period, now) if period is not None else 0.0
        self.fallback: TokenBucket | None = None

    # -- what admission asks (the Pool protocol) --

    def resize(self, capacity: int, now: float) -> None:
        self.capacity = capacity
        self.left = min(self.left, float(capacity))
        if self.fallback is not None:
            self.fallback.resize(self.owner.fallback_capacity(capacity), now)

    def _roll(self, now: float) -> None:
        if self.period is not None and period_start(self.period, now) != self.start:
            self.start = period_start(self.period, now)
            self.held, self.consumed, self.in_use = 0, 0, 0  # last period's lease lapses with its counter
            self.left = self.unused = float(self.capacity)

    def _fallback(self, now: float) -> TokenBucket:
        if self.fallback is None:
            self.fallback = TokenBucket(self.owner.fallback_capacity(self.capacity), now, WINDOW)
        return self.fallback

    def room(self, now: float) -> float:
        self._roll(now)
        if self.owner.degraded:
            if self.kind == BUCKET:
                return self._fallback(now).room(now)
            if self.kind == SLOTS:
                return self.owner.fallback_capacity(self.capacity) - self.in_use
            if not self.owner.budgets_fail_closed:
                return math.inf
            if self.kind == BUDGET and now - self.renewed_at >= self.owner.holder_ttl_ms / 1000:
                return min(0, self.held)  # Redis has dropped this holder: its lease may be leased to others now
        return self.held

    def reserve(self, amount: int, now: float) -> int:
        self._roll(now)
        self._note_demand(amount, now)
        if self.owner.degraded and self.kind == BUCKET:
            self._fallback(now).reserve(amount, now)
            return FALLBACK
        self.held -= amount
        if self.kind != BUCKET:
            self.in_use += amount
        if self.kind == SLOTS:
            if self.held < 0:  # the fallback's slots (Redis away) are counted in Redis when it is back
                self.held = 0
        elif not self.owner.degraded and self.held < self.lease_size() / 2:
            self.owner.refill_soon(self)
        return int(self.start)

    def adjust(self, reserved: int, used: int, stamp: int, now: float) -> None:
        self._roll(now)
        if self.kind == BUCKET and stamp == FALLBACK:
            self._fallback(now).adjust(reserved, used, stamp, now)
        elif self.kind == SLOTS:
            self.in_use = max(0, self.in_use - reserved)
            self.held += reserved
            if self.left <= 0 and not self.owner.degraded:  # none was free: another process may wait for it
                self.owner.give_soon(self)
        elif stamp == int(self.start):
            self.held += reserved - used
            self.in_use = max(0, self.in_use - reserved)
        else:  # reserved in a period that has ended: its use counts in this one
            self.held -= used
        if self.kind == BUDGET:
            self.consumed += used

    def wait(self, amount: int, now: float) -> float:
        if self.kind == SLOTS:
            return CONCURRENCY_RETRY
        if self.kind == BUDGET:
            assert self.period is not None
            if amount > self.capacity:
                return math.inf
            if not self.exhausted(amount, now):  # the rest is in leases or requests in flight: back shortly
                return self.owner.lease_idle_seconds
            return period_end(self.period, now) - now
        if self.owner.degraded:
            return self._fallback(now).wait(amount, now)
        rate = self.capacity / WINDOW
        if rate <= 0:
            return math.inf
        missing = min(float(amount), float(self.capacity)) - self.held - self.left_now(now)
        return max(0.0, missing / rate)

    def exhausted(self, amount: int, now: float) -> bool:
        """A budget: what was used (as Redis last said, and what this process's answers used since) leaves less
        than ``amount``; else what is missing is held by leases or requests in flight, and comes back."""
        if self.kind != BUDGET:
            return False
        self._roll(now)
        if self.owner.degraded:  # nothing is known of the others' use: as before, spent
            return True
        return self.unused - self.consumed < amount

    def remaining(self, now: float) -> int:
        if self.owner.degraded and self.kind == BUCKET:
            return self._fallback(now).remaining(now)
        return max(0, min(self.capacity, int(self.held + self.left_now(now))))

    def reset_in(self, now: float) -> float:
        if self.kind == BUDGET:
            assert self.period is not None
            return period_end(self.period, now) - now
        if self.kind == SLOTS or self.capacity <= 0:
            return 0.0
        return max(0.0, (self.capacity - self.remaining(now)) / (self.capacity / WINDOW))

    # -- what the limiter's lease calls do --

    def left_now(self, now: float) -> float:
        if self.kind != BUCKET:
            return self.left
        return min(float(self.capacity), self.left + max(0.0, now - self.left_at) * self.capacity / WINDOW)

    def _note_demand(self, amount: int, now: float) -> None:
        elapsed = max(0.0, now - self.demand_at)
        # an exponentially weighted rate: its mean over time is the rate of reservations, whatever their sizes
        self.demand = self.demand * 0.5 ** (elapsed / DEMAND_HALF_LIFE) + amount * math.log(2) / DEMAND_HALF_LIFE
        self.demand_at, self.last_use = now, now

    def _fair_share(self, now: float) -> int:
        """The most a lease ahead of need takes: half of what Redis had left over the live processes, so that
        near the end of a limit the shares held ahead do not keep it from the others' requests."""
        return max(1, math.floor(self.left_now(now) / (2 * self.owner.live)))

    def lease_size(self) -> int:
        """What one lease takes: ``lease_seconds`` of the recent demand, at least 1, at most the capacity."""
        return max(1, min(self.capacity, math.ceil(self.demand * self.owner.lease_seconds)))

    def ask(self, amount: int) -> None:
        """A waiting request lacks ``amount``: the next call asks for it (with what the others lack)."""
        amount = max(0, amount)
        self.asked += amount
        self.least = amount if not self.least else min(self.least, amount)

    def forget_asks(self) -> None:
        """Redis is away: the requests that asked were answered by the fallback."""
        self.asked = self.least = 0

    def operation(self, now: float, idle: bool) -> Operation | None:
        """This pool's part of the next call (and the local bookkeeping of what it gives and charges), or None
        when it has nothing to ask, give, owe or renew. ``idle``: give back all it holds."""
        self._roll(now)
        self._sent_at = now
        need, asked = self.least, self.asked
        self.least = 0
        if self.kind == SLOTS:
            give = self.held if idle else 0
            want = asked
            self.held -= give
            have = self.in_use + self.held
            if not (want or give or have):
                return None
            return Operation(SLOTS, (self._base, self._base + ":holders"), self.capacity, need, want,
                             extra=self.owner.holder, have=have, ttl_ms=self.owner.holder_ttl_ms)
        give = max(0, self.held) if idle else 0
        if self.kind == BUDGET and self.starved and asked and self.held > 0:
            # the rest of the budget is in pieces over processes, none enough: put this one back with the others,
            # and ask for the whole (granted here if the pieces make it; else to the process that asks next)
            give = self.held
            need, asked = need + give, asked + give
        charge = max(0, -self.held)
        self.held += charge - give
        want = 0 if idle else max(asked, min(self.lease_size() - self.held, self._fair_share(now)))
        consumed, self.consumed = self.consumed, 0
        if self.kind == BUCKET:
            if not (want or give or charge):
                return None
            return Operation(BUCKET, (self._base,), self.capacity, need, want, give, charge, int(WINDOW * 1000))
        have = self.held + self.in_use  # what Redis counts as this holder's: renewed while there is any
        if not (want or give or charge or consumed or have):
            return None
        assert self.period is not None
        key = budget_key(self._base, self.period, self.start)
        return Operation(BUDGET, budget_keys(key), self.capacity, need, want, give, charge,
                         budget_expiry_ms(self.period, now), have=have, ttl_ms=self.owner.holder_ttl_ms,
                         consumed=consumed)

    def answered(self, answer: Answer, asked: int, now: float, sent: Operation | None = None,
                 late: bool = False) -> None:
        """Redis granted ``answer.granted`` to the call that carried ``sent``; the asks it answered (``asked``) are
        done. ``late``: the call was sent again after its answer was lost (this is its first answer)."""
        if self.kind == SLOTS and sent is not None:
            # Redis counts sent.have + granted slots as this holder's until its next call says what it holds; the
            # slots reserved since the call are among them, but not those the fallback lent while Redis seemed away.
            # A late answer's grant is not used at all: it was made before every process's fallback lent its share
            # (which Redis learns only from their next calls); this holder's next call gives it back.
            self.held = max(0, sent.have + (0 if late else answer.granted) - self.in_use)
        else:
            self.held += answer.granted
        self.asked = max(0, self.asked - asked)
        self.left, self.left_at = answer.left, now
        if self.kind == BUDGET:
            self.unused = answer.unused
            self.starved = asked > 0 and answer.granted == 0
            self.renewed_at = max(self.renewed_at, self._sent_at)

    def unanswered(self, operation: Operation, asked: int) -> None:
        """The call failed: what it gave or charged stays to be given or charged."""
        self.held += operation.give - operation.charge
        self.consumed += operation.consumed
        self.asked = max(0, self.asked - asked)

    def idle(self, now: float, idle_seconds: float) -> bool:
        return self.held > 0 and now - self.last_use >= idle_seconds

    def owes(self) -> bool:
        """Something to report at the next call: a share to refill or renew, a debt, a budget's consumption."""
        return bool(self.held or self.in_use or self.consumed)
