"""What the data plane calls of tenancy, and nothing else: three small interfaces and their answers.

A request's way through them (``llmgw/gateway/dataplane.py``):

1. ``tenant = directory.lookup(authorization)``: who it is (None: 401), from a local copy;
2. ``tenant.may_use(model)`` (no: 403 ``model_not_allowed``);
3. ``admitted = await limiter.admit(tenant, model, estimate)``: an :class:`Admission` (its
   ``headers`` go on the answer) or a :class:`Refusal` (429 with ``Retry-After``). It waits on
   Redis only when the tenant's local lease cannot cover the request (its first, a burst);
4. once the answer ended, however it ended, ``admitted.settle(usage)`` exactly once: the
   reservation is replaced by what was used (None: nothing reached an engine, the tokens go back);
5. ``usage_sink.record(UsageRecord(...))`` for every answer an engine produced, and
   ``usage_sink.refused(tenant, model, reason)`` for every 429 and 403 of steps 2 and 3.

Each is implemented twice at most: in this process (``state.backend: local``, SQLite in the state dir)
and through Redis (a cluster, and ``--workers``); :class:`Tenancy` bundles the ones a gateway runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .model import Estimate, PriceList, TenancySettings, Tenant, Usage


class StoreUnavailable(Exception):
    """A tenancy store (keys and teams, or usage) did not take a call now: Redis away, the SQLite file locked or
    unwritable. The caller keeps what it has and retries later."""


RATE_LIMITED = "rate_limit_exceeded"  # OpenAI's error type for rpm, tpm and concurrency
OUT_OF_QUOTA = "insufficient_quota"  # OpenAI's error type for a spent budget


class KeyDirectory(Protocol):
    """Who a bearer token is. Reads a local copy only; the copy follows the store within a second."""

    @property
    def required(self) -> bool:
        """Whether /v1 needs a key at all (any key is configured or created); False: open, as without api_keys."""

    def lookup(self, authorization: str | None) -> Tenant | None:
        """The tenant an ``Authorization: Bearer <key>`` header value carries, or None. Its time does not depend
        on which key matched, or on how much of one."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """A request the limiter will not admit now: answered 429 in OpenAI's shape, with ``Retry-After``."""

    error_type: str  # RATE_LIMITED or OUT_OF_QUOTA
    message: str  # names the limit, the key or team, and when it frees up
    retry_after: float  # seconds until the limit would admit it (a budget: until its period ends)
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)  # x-ratelimit-* (and retry-after)
    status: int = 429


class Admission(Protocol):
    """An admitted request's reservation against every limit of its key and team."""

    headers: list[tuple[bytes, bytes]]  # x-ratelimit-{limit,remaining,reset}-{requests,tokens}; [] when unlimited

    def settle(self, usage: Usage | None) -> None:
        """Replace the reservation by what was used (``None``: nothing reached an engine; the tokens and money
        go back, the request still counts in rpm). Never waits; a second call does nothing."""


class Limiter(Protocol):
    async def admit(self, tenant: Tenant, model: str, estimate: Estimate) -> Admission | Refusal:
        """Reserve ``estimate`` against the key's and its team's limits, or say why not. Cancelling it leaves
        nothing reserved."""


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """One answer's usage, as the usage store aggregates it (per key, team, model, priority class and hour)."""

    key_id: str
    key_name: str
    team: str | None
    model: str
    usage: Usage
    status: int
    at: float  # time.time() when the answer ended
    priority: str | None = None  # the configured class the gateway's queue gave it (None: it did not queue)


class UsageSink(Protocol):
    def record(self, record: UsageRecord) -> None:
        """Take one answer's usage; never waits (it reaches the store within ``usage_flush_interval``)."""

    def refused(self, tenant: Tenant, model: str, reason: str, at: float | None = None,
                priority: str | None = None) -> None:
        """Count one request refused before routing, in its key's usage: ``reason`` is the 429's error type
        (``rate_limit_exceeded``, ``insufficient_quota``) or ``model_not_allowed`` (the 403); ``priority``: its
        class when the gateway's queue shed it; never waits."""


@dataclass
class Tenancy:
    """What one gateway process runs of tenancy; the data plane holds it and swaps it whole on reload."""

    directory: KeyDirectory
    limiter: Limiter
    usage: UsageSink
    prices: PriceList
    settings: TenancySettings
