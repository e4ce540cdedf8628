"""The value types of tenancy: tenants and their limits, prices, an admission's estimate and an answer's usage.

Money is an ``int`` of nano-dollars (1e-9 USD) everywhere: sums are exact, and a
Redis counter (``INCRBY``, 64 bits) holds 9.2 billion dollars. A price is given in
USD per million tokens (as every provider lists them) and kept as nano-dollars per
token, so it may have up to three decimals (0.001 USD per million tokens is one
nano-dollar per token); a cost is a product of integers.

Every type here is immutable: a change (a reload, ``POST /admin/keys``) builds new
ones and swaps them in whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from decimal import Decimal

NANO_PER_USD = 1_000_000_000
PERIODS = ("day", "month", "total")  # a budget's period: the UTC day, the UTC month, or for ever
DIMENSIONS = ("requests", "tokens", "concurrency", "budget_tokens", "budget_usd")  # what a limit counts


def usd_to_nano(usd: Decimal | str | float) -> int:
    """``usd`` dollars as nano-dollars; ``ValueError`` when it is negative or finer than a nano-dollar."""
    value = Decimal(str(usd)) * NANO_PER_USD
    if value < 0 or value != value.to_integral_value():
        raise ValueError(f"{usd} USD is not a whole number of nano-dollars (at most 9 decimals) >= 0")
    return int(value)


def nano_to_usd(nano: int) -> float:
    """For display (JSON, metrics): nano-dollars as dollars."""
    return nano / NANO_PER_USD


@dataclass(frozen=True, slots=True)
class Budget:
    """A cap on what a key or a team uses in a period: tokens (as :meth:`TenancySettings.counted_tokens` counts
    them) and/or money."""

    period: str  # one of PERIODS
    tokens: int | None = None
    nano_usd: int | None = None


@dataclass(frozen=True, slots=True)
class Limits:
    """The limits of one key or one team; None: unlimited in that dimension."""

    rpm: int | None = None  # requests per minute (a token bucket of rpm, refilled at rpm per minute)
    tpm: int | None = None  # tokens per minute (the same, of tokens)
    concurrency: int | None = None  # requests in flight at once
    budgets: tuple[Budget, ...] = ()

    def __bool__(self) -> bool:
        return self.rpm is not None or self.tpm is not None or self.concurrency is not None or bool(self.budgets)


NO_LIMITS = Limits()


@dataclass(frozen=True, slots=True)
class Team:
    name: str
    limits: Limits = NO_LIMITS
    models: frozenset[str] | None = None  # the models its keys may use; None: every model
    priority: str | None = None  # its keys' priority class (issue 31's admission), unless a key says its own
    priority_header: bool = False  # its keys' requests may raise their class with the priority header


@dataclass(frozen=True, slots=True)
class Tenant:
    """One API key as the data plane sees it once the bearer token matched."""

    key_id: str  # stable, public, safe to log and to use as a label: "cfg-<name>" or an API key's "k-<hex>"
    name: str  # who holds it (the access log's ``key``, usage's key name)
    team: Team | None = None
    models: frozenset[str] | None = None  # None: every model (the team's list still applies)
    priority: str | None = None
    limits: Limits = NO_LIMITS
    source: str = "config"  # "config" (the file) or "api" (POST /admin/keys)
    priority_header: bool = False  # its requests may raise their class with the priority header (as may its team's)

    def may_use(self, model: str) -> bool:
        """Whether this key may send requests to ``model`` (its own list and its team's both allow it)."""
        if self.models is not None and model not in self.models:
            return False
        team = self.team
        return team is None or team.models is None or model in team.models

    @property
    def limited(self) -> bool:
        """Whether anything limits this key (it or its team): its answers carry the ``x-ratelimit-*`` headers."""
        return bool(self.limits) or (self.team is not None and bool(self.team.limits))

    @property
    def class_name(self) -> str | None:
        """The priority class of its requests: its own, else its team's."""
        return self.priority or (self.team.priority if self.team is not None else None)

    @property
    def may_raise_priority(self) -> bool:
        """Whether its requests' priority header may name a class above theirs (it or its team allows it)."""
        return self.priority_header or (self.team is not None and self.team.priority_header)


@dataclass(frozen=True, slots=True)
class Price:
    """One model's price, in nano-dollars per token (USD per million tokens x 1,000)."""

    input: int = 0
    cached_input: int = 0
    output: int = 0

    def cost(self, input_tokens: int, cached_tokens: int, output_tokens: int) -> int:
        """Nano-dollars for a request: ``input_tokens`` counts the cached ones too (as OpenAI's
        ``prompt_tokens`` does); those are charged at the cached price."""
        cached = min(cached_tokens, input_tokens)
        return (input_tokens - cached) * self.input + cached * self.cached_input + output_tokens * self.output


FREE = Price()


@dataclass(frozen=True, slots=True)
class PriceList:
    by_model: dict[str, Price] = field(default_factory=dict)

    def of(self, model: str) -> Price:
        return self.by_model.get(model, FREE)


@dataclass(frozen=True, slots=True)
class Estimate:
    """What an admission reserves: the prompt's tokens (the tokenizer's count where the route has one, else a
    bounded upper estimate from the body) and the most output tokens (``max_tokens``/``max_completion_tokens``,
    else the configured cap), and their cost at the model's price (input at the uncached price)."""

    prompt_tokens: int
    max_output_tokens: int
    nano_usd: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.max_output_tokens


@dataclass(frozen=True, slots=True)
class Usage:
    """What an answer used, from the engine's ``usage`` (or, for a stream broken off, what was sent)."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    nano_usd: int = 0


@dataclass(frozen=True, slots=True)
class TenancySettings:
    """The knobs of tenancy (the config's ``tenancy`` section; docs/configuration.md)."""

    default_max_tokens: int = 4096  # reserved for output when a request gives no max_tokens
    max_prompt_estimate: int = 1_000_000  # the most prompt tokens a body-size estimate reserves
    cached_input_weight: float = 1.0  # how much a cached input token counts in tpm and token budgets (0..1)
    budgets_fail_closed: bool = True  # Redis away: budgets admit only what this process's lease still holds
    lease_seconds: float = 0.5  # a leased share is sized to this long of the process's recent demand
    lease_idle_seconds: float = 2.0  # a share not drawn on for this long goes back to the shared pool
    usage_flush_interval: float = 0.1  # settled usage reaches the store within this

    def counted_tokens(self, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> int:
        """The tokens a request counts in ``tpm`` and token budgets: input (cached input at
        ``cached_input_weight``) plus output, rounded up."""
        cached = min(cached_tokens, prompt_tokens)
        weighted = (prompt_tokens - cached) + cached * self.cached_input_weight + completion_tokens
        whole = int(weighted)
        return whole if whole == weighted else whole + 1
