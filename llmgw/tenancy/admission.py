"""Reserving one request against every pool of its key and its team at once, or refusing it: the part of
admission that does not depend on where the pools' allowance comes from (this process alone, or leases of a
Redis pool: :mod:`.local_limiter`, :mod:`.redis_limiter`).

A request passes its key's limits and its team's. What it reserves in each dimension: 1 request, its
estimate's tokens (as :meth:`~.model.TenancySettings.counted_tokens` counts them), 1 concurrency slot, and the
same tokens and its estimated money against budgets. Settling replaces each reservation by what the answer
used (no answer: no tokens, no money; the request still counts in rpm; the slot always comes back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

from .interfaces import OUT_OF_QUOTA, RATE_LIMITED, Refusal
from .limiter_metrics import LimiterMetrics
from .model import Estimate, Limits, TenancySettings, Tenant, Usage
from .ratelimit_headers import Window, ratelimit_headers, retry_after_header

KEY, TEAM = "key", "team"
REQUESTS, TOKENS, CONCURRENCY, BUDGET_TOKENS, BUDGET_USD = "requests", "tokens", "concurrency", "budget_tokens", \
    "budget_usd"
BUDGETS = (BUDGET_TOKENS, BUDGET_USD)
MAX_RETRY_AFTER = 86_400.0  # what never frees up by itself (a total budget) says: ask again in a day
NO_TEAM = "none"  # the metrics' team label of a key without a team


class Pool(Protocol):
    """What admission asks of one limit's allowance (:mod:`.pools`, :mod:`.leases`)."""

    capacity: int

    def resize(self, capacity: int, now: float) -> None: ...

    def room(self, now: float) -> float: ...

    def reserve(self, amount: int, now: float) -> int: ...

    def adjust(self, reserved: int, used: int, stamp: int, now: float) -> None: ...

    def wait(self, amount: int, now: float) -> float: ...

    def remaining(self, now: float) -> int: ...

    def exhausted(self, amount: int, now: float) -> bool:
        """A budget whose use so far (not what leases and requests in flight hold) leaves less than ``amount``."""
        ...

    def reset_in(self, now: float) -> float: ...


@dataclass(frozen=True, slots=True)
class Subject:
    """Who a limit belongs to: a key (by its id) or a team (by its name)."""

    kind: str  # KEY or TEAM
    name: str  # the key's id, the team's name
    shown: str  # how a message names it: the key's name, the team's

    def describe(self) -> str:
        return f"{self.kind} {self.shown!r}"


@dataclass(frozen=True, slots=True)
class Slot:
    """One pool of a subject, with the dimension it counts and, for a budget, its period."""

    subject: Subject
    dimension: str
    period: str | None
    pool: Pool


@dataclass(slots=True)
class Reservation:
    slot: Slot
    amount: int
    stamp: int


def subjects_of(tenant: Tenant) -> list[tuple[Subject, Limits]]:
    """The key's and its team's limits (those that limit anything)."""
    found = []
    if tenant.limits:
        found.append((Subject(KEY, tenant.key_id, tenant.name), tenant.limits))
    team = tenant.team
    if team is not None and team.limits:
        found.append((Subject(TEAM, team.name, team.name), team.limits))
    return found


def amount_for(dimension: str, estimate_tokens: int, estimate: Estimate) -> int:
    if dimension in (REQUESTS, CONCURRENCY):
        return 1
    if dimension == BUDGET_USD:
        return estimate.nano_usd
    return estimate_tokens


def used_for(dimension: str, reserved: int, used_tokens: int, usage: Usage | None) -> int:
    """What a settled request counts in ``dimension``: its request stays counted, its slot comes back."""
    if dimension == REQUESTS:
        return reserved
    if dimension == CONCURRENCY:
        return 0
    if usage is None:
        return 0
    return usage.nano_usd if dimension == BUDGET_USD else used_tokens


def describe_limit(slot: Slot) -> str:
    capacity = slot.pool.capacity
    if slot.dimension == REQUESTS:
        return f"{capacity} requests per minute"
    if slot.dimension == TOKENS:
        return f"{capacity} tokens per minute"
    if slot.dimension == CONCURRENCY:
        return f"{capacity} concurrent requests"
    what = f"{capacity} tokens" if slot.dimension == BUDGET_TOKENS else f"{capacity / 1e9:.9g} USD"
    return f"budget of {what} per {slot.period}" if slot.period != "total" else f"total budget of {what}"


def window_of(slots: list[Slot], dimension: str, now: float) -> Window | None:
    """The header values of ``dimension``'s tightest pool (the one with the least left), if any limits it."""
    tightest = None
    for slot in slots:
        if slot.dimension == dimension:
            remaining = slot.pool.remaining(now)
            if tightest is None or remaining < tightest.remaining:
                tightest = Window(slot.pool.capacity, remaining, slot.pool.reset_in(now))
    return tightest


def headers_of(slots: list[Slot], now: float) -> list[tuple[bytes, bytes]]:
    return ratelimit_headers(window_of(slots, REQUESTS, now), window_of(slots, TOKENS, now))


class Settlement:
    """An admitted request's reservations; :meth:`settle` gives back what it did not use, exactly once."""

    __slots__ = ("headers", "_reservations", "_settings", "_clock", "_done", "_on_settle")

    def __init__(self, headers: list[tuple[bytes, bytes]], reservations: list[Reservation],
                 settings: TenancySettings, clock: Callable[[], float],
                 on_settle: Callable[[list[Reservation]], None] | None = None):
        self.headers = headers
        self._reservations = reservations
        self._settings = settings
        self._clock = clock
        self._done = False
        self._on_settle = on_settle

    def settle(self, usage: Usage | None) -> None:
        if self._done:
            return
        self._done = True
        used_tokens = 0 if usage is None else self._settings.counted_tokens(
            usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
        now = self._clock()
        for reservation in self._reservations:
            used = used_for(reservation.slot.dimension, reservation.amount, used_tokens, usage)
            reservation.slot.pool.adjust(reservation.amount, used, reservation.stamp, now)
        if self._on_settle is not None:
            self._on_settle(self._reservations)


def needs_of(slots: list[Slot], estimate: Estimate, settings: TenancySettings) -> list[tuple[Slot, int]]:
    tokens = settings.counted_tokens(estimate.prompt_tokens, 0, estimate.max_output_tokens)
    return [(slot, amount_for(slot.dimension, tokens, estimate)) for slot in slots]


def short_of(needs: list[tuple[Slot, int]], now: float) -> list[tuple[Slot, int]]:
    """The needs their pool cannot cover now."""
    return [(slot, amount) for slot, amount in needs if slot.pool.room(now) < amount]


def reserve(needs: list[tuple[Slot, int]], now: float) -> list[Reservation]:
    return [Reservation(slot, amount, slot.pool.reserve(amount, now)) for slot, amount in needs]


def refusal(slots: list[Slot], short: list[tuple[Slot, int]], now: float, metrics: LimiterMetrics,
            team: str) -> Refusal:
    """The 429 of a request some pools cannot cover: the one that frees up last names the reason."""
    waits = [(slot.pool.wait(amount, now), slot, amount) for slot, amount in short]
    wait, slot, amount = max(waits, key=lambda item: item[0])
    for _, counted, _ in waits:
        metrics.limited.labels(team, counted.dimension).inc()
    spent = slot.dimension in BUDGETS and slot.pool.exhausted(amount, now)
    error_type = OUT_OF_QUOTA if spent else RATE_LIMITED  # a budget held by requests in flight frees up soon
    retry_after = MAX_RETRY_AFTER if math.isinf(wait) else wait
    if amount > slot.pool.capacity:
        message = (f"This request needs {amount} of the {slot.subject.describe()}'s {describe_limit(slot)}: it "
                   "can never be admitted; ask for fewer tokens (max_tokens) or a higher limit.")
    elif slot.dimension in BUDGETS and not spent:
        message = (f"The rest of the {describe_limit(slot)} of the {slot.subject.describe()} is held by requests "
                   f"in flight (or other gateways' shares of it); retry in {retry_after:.3g} s.")
    elif error_type == OUT_OF_QUOTA:
        when = "only raising it frees it" if math.isinf(wait) else f"it renews in {math.ceil(wait)} s"
        message = f"The {slot.subject.describe()} has spent its {describe_limit(slot)}; {when}."
    else:
        message = (f"The {slot.subject.describe()} reached its limit of {describe_limit(slot)}; retry in "
                   f"{retry_after:.3g} s.")
    return Refusal(error_type, message, retry_after, [*headers_of(slots, now), retry_after_header(retry_after)])


def team_label(tenant: Tenant) -> str:
    return tenant.team.name if tenant.team is not None else NO_TEAM
