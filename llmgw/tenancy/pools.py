"""The three kinds of allowance a limit is made of, in one process: token buckets, slots and period budgets.

Every limit of a key or a team is one *pool* (its dimension says what it counts, :data:`~.model.DIMENSIONS`):

- :class:`TokenBucket` for ``rpm`` and ``tpm``: it holds at most the limit, refills continuously at the limit
  per minute, and may go below zero when an answer used more tokens than its reservation (later requests wait
  for the debt to refill);
- :class:`Slots` for ``concurrency``: requests in flight, given back when each ends;
- :class:`PeriodBudget` for budgets: what was spent in the current UTC day, UTC month or ever, started afresh
  when its period rolls over.

They share one small interface, so that an admission (:mod:`.admission`) reserves across all of a request's
pools at once, or in none. Times are a wall clock's seconds (``time.time()``): budgets follow the UTC calendar.
"""

from __future__ import annotations

import calendar
import math
import time

CONCURRENCY_RETRY = 1.0  # a full concurrency limit frees up when a request ends: when is unknown; ask again in 1 s
DAY = 86_400.0


def period_start(period: str, now: float) -> float:
    """When the UTC ``period`` (day, month, total) holding ``now`` began (total: the epoch)."""
    if period == "day":
        return (now // DAY) * DAY
    if period == "month":
        moment = time.gmtime(now)
        return float(calendar.timegm((moment.tm_year, moment.tm_mon, 1, 0, 0, 0)))
    return 0.0


def period_end(period: str, now: float) -> float:
    """When the UTC ``period`` holding ``now`` ends (total: never, ``inf``)."""
    if period == "day":
        return period_start(period, now) + DAY
    if period == "month":
        moment = time.gmtime(now)
        year, month = (moment.tm_year + 1, 1) if moment.tm_mon == 12 else (moment.tm_year, moment.tm_mon + 1)
        return float(calendar.timegm((year, month, 1, 0, 0, 0)))
    return math.inf


class TokenBucket:
    """``capacity`` units, refilled at ``capacity`` per ``window`` seconds, continuously."""

    __slots__ = ("capacity", "rate", "level", "at")

    def __init__(self, capacity: int, now: float, window: float = 60.0):
        self.capacity = capacity
        self.rate = capacity / window  # units per second
        self.level = float(capacity)
        self.at = now

    def resize(self, capacity: int, now: float, window: float = 60.0) -> None:
        """A new limit (a reload, an update of the key): what was used stays used."""
        self._refill(now)
        self.level = min(self.level - self.capacity + capacity, float(capacity))
        self.capacity, self.rate = capacity, capacity / window

    def _refill(self, now: float) -> None:
        if now > self.at:
            self.level = min(float(self.capacity), self.level + (now - self.at) * self.rate)
            self.at = now

    def room(self, now: float) -> float:
        self._refill(now)
        return self.level

    def reserve(self, amount: int, now: float) -> int:
        self._refill(now)
        self.level -= amount
        return 0

    def adjust(self, reserved: int, used: int, stamp: int, now: float) -> None:
        """Replace a reservation of ``reserved`` by ``used`` (more: the bucket goes below zero)."""
        self._refill(now)
        self.level = min(float(self.capacity), self.level + reserved - used)

    def wait(self, amount: int, now: float) -> float:
        """Seconds until ``amount`` fits (more than the capacity never does: until the bucket is full)."""
        self._refill(now)
        if self.rate <= 0:
            return math.inf
        target = min(float(amount), float(self.capacity))
        return max(0.0, (target - self.level) / self.rate)

    def remaining(self, now: float) -> int:
        self._refill(now)
        return max(0, int(self.level))

    def exhausted(self, amount: int, now: float) -> bool:
        return False  # a rate: it refills

    def reset_in(self, now: float) -> float:
        """Seconds until the bucket is full again (OpenAI's ``x-ratelimit-reset-*``)."""
        self._refill(now)
        return 0.0 if self.rate <= 0 else max(0.0, (self.capacity - self.level) / self.rate)


class Slots:
    """At most ``capacity`` requests in flight."""

    __slots__ = ("capacity", "used")

    def __init__(self, capacity: int, now: float):
        self.capacity = capacity
        self.used = 0

    def resize(self, capacity: int, now: float) -> None:
        self.capacity = capacity

    def room(self, now: float) -> float:
        return self.capacity - self.used

    def reserve(self, amount: int, now: float) -> int:
        self.used += amount
        return 0

    def adjust(self, reserved: int, used: int, stamp: int, now: float) -> None:
        self.used = max(0, self.used - reserved + used)

    def wait(self, amount: int, now: float) -> float:
        return CONCURRENCY_RETRY

    def remaining(self, now: float) -> int:
        return max(0, self.capacity - self.used)

    def exhausted(self, amount: int, now: float) -> bool:
        return False  # slots come back

    def reset_in(self, now: float) -> float:
        return 0.0


class PeriodBudget:
    """At most ``capacity`` units spent per UTC ``period``; the spend starts from zero when the period rolls."""

    __slots__ = ("capacity", "period", "spent", "in_flight", "start")

    def __init__(self, capacity: int, now: float, period: str):
        self.capacity = capacity
        self.period = period
        self.spent = 0  # used, and reserved by the requests in flight
        self.in_flight = 0  # reserved by requests not settled yet: they give back what they do not use
        self.start = period_start(period, now)

    def resize(self, capacity: int, now: float) -> None:
        self.capacity = capacity

    def _roll(self, now: float) -> None:
        start = period_start(self.period, now)
        if start != self.start:
            self.start, self.spent, self.in_flight = start, 0, 0

    def seed(self, spent: int, now: float) -> None:
        """Add what the usage store says was spent in the current period before this process started."""
        self._roll(now)
        self.spent += max(0, spent)

    def room(self, now: float) -> float:
        self._roll(now)
        return self.capacity - self.spent

    def reserve(self, amount: int, now: float) -> int:
        """Reserve; the stamp is the period's start (a settle in the next period charges the new one)."""
        self._roll(now)
        self.spent += amount
        self.in_flight += amount
        return int(self.start)

    def adjust(self, reserved: int, used: int, stamp: int, now: float) -> None:
        self._roll(now)
        if stamp == int(self.start):
            self.spent = max(0, self.spent - reserved + used)
            self.in_flight = max(0, self.in_flight - reserved)
        else:  # reserved in a period that has ended: what was used counts in this one
            self.spent += used

    def wait(self, amount: int, now: float) -> float:
        """Until the period ends (never for a total budget, or for more than the whole budget); when what is
        missing is reserved by requests in flight, until one ends (unknown: as a full concurrency limit)."""
        if amount > self.capacity:
            return math.inf
        if not self.exhausted(amount, now):
            return CONCURRENCY_RETRY
        return period_end(self.period, now) - now

    def exhausted(self, amount: int, now: float) -> bool:
        """What was used leaves less than ``amount`` (not counting what requests in flight reserved)."""
        self._roll(now)
        return self.capacity - (self.spent - self.in_flight) < amount

    def remaining(self, now: float) -> int:
        self._roll(now)
        return max(0, self.capacity - self.spent)

    def reset_in(self, now: float) -> float:
        return period_end(self.period, now) - now
