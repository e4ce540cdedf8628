"""The key directory: who a bearer token is, from the SHA-256 of the token looked up in a dict.

Keys come from two places: the config file (``api_keys``, ``teams``: source ``config``) and the key store
(``POST /admin/keys``, ``/admin/teams``: source ``api``). Each is a list of :class:`KeyEntry` and
:class:`TeamEntry` (what a store keeps: a key's SHA-256, never the key); :class:`Directory` joins both into one
dict from a key's digest to its :class:`~.model.Tenant`, and swaps that dict whole whenever either changes (a
reload, a store's new version), so a lookup reads one consistent copy and never waits.

Why a dict lookup by digest is as safe as comparing in constant time (docs/security.md): the dict compares
SHA-256 digests of the presented token, never the token with a key. Its timing can tell at most how many leading
bytes of a *digest* matched (a hash bucket, a prefix compare), and learning a digest's prefix says nothing about
which token produces it (finding a preimage of a chosen prefix costs a brute force of that prefix, and the secret
keys are 256 random bits, or whatever entropy an operator's key has, which no timing shortens).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from ..config import Config
from ..config.schema import ApiKey, BudgetConfig, TeamConfig, TenantLimits
from ..http.messages import bearer_token
from .model import NO_LIMITS, Budget, Limits, Price, PriceList, Team, Tenant, usd_to_nano

log = logging.getLogger(__name__)
CONFIG = "config"  # a key or team from the config file: listed by the admin API, never changed by it
API = "api"  # one made by the admin API, kept in the key store


def digest_of(token: str) -> bytes:
    """The SHA-256 of a key (its UTF-8): the directory's lookup key."""
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def presented_digest(token: str) -> bytes:
    """The SHA-256 of a token as the client sent it: a header value reaches us decoded as latin-1, so its bytes
    are that encoding's (a non-ASCII key the client sent as UTF-8 matches the config's)."""
    try:
        raw = token.encode("latin-1")
    except UnicodeEncodeError:  # not from an HTTP header: taken as text
        raw = token.encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).digest()


@dataclass(frozen=True, slots=True)
class TeamEntry:
    """A team as a store keeps it (and as the admin API lists it)."""

    name: str
    limits: Limits = NO_LIMITS
    models: frozenset[str] | None = None
    priority: str | None = None
    source: str = API
    created: float = 0.0  # time.time() it was made; 0 for the config's
    priority_header: bool = False

    def team(self) -> Team:
        return Team(self.name, self.limits, self.models, self.priority, self.priority_header)


@dataclass(frozen=True, slots=True)
class KeyEntry:
    """An API key as a store keeps it: its SHA-256 (32 bytes), never the key."""

    key_id: str  # "cfg-<name>" for the config's, "k-<hex>" for the admin API's
    name: str
    digest: bytes
    team: str | None = None
    models: frozenset[str] | None = None
    priority: str | None = None
    limits: Limits = NO_LIMITS
    source: str = API
    created: float = 0.0
    priority_header: bool = False

    def tenant(self, team: Team | None) -> Tenant:
        return Tenant(self.key_id, self.name, team, self.models, self.priority, self.limits, self.source,
                      self.priority_header)


class Directory:
    """The :class:`~.interfaces.KeyDirectory` of a gateway: config keys and stored keys, joined.

    :meth:`set_config` (start, reload) and :meth:`set_stored` (a store's poller) each rebuild the joined dict
    and swap it in whole.

    /v1 needs a key while any key exists, with ``require`` (``tenancy.require_keys``), and, once this process has
    known a key, for the rest of its life: revoking the last key made by the API must not open /v1."""

    def __init__(self, keys: Iterable[KeyEntry] = (), teams: Iterable[TeamEntry] = (), require: bool = False):
        self._config: tuple[tuple[KeyEntry, ...], tuple[TeamEntry, ...]] = (tuple(keys), tuple(teams))
        self._stored: tuple[tuple[KeyEntry, ...], tuple[TeamEntry, ...]] = ((), ())
        self._by_digest: dict[bytes, Tenant] = {}
        self._require = require
        self._join()

    @property
    def required(self) -> bool:
        return self._require

    def lookup(self, authorization: str | None) -> Tenant | None:
        token = bearer_token(authorization)
        if token is None:
            return None
        return self._by_digest.get(presented_digest(token))

    def set_config(self, keys: Iterable[KeyEntry], teams: Iterable[TeamEntry], require: bool = False) -> None:
        self._config = (tuple(keys), tuple(teams))
        self._require = self._require or require
        self._join()

    def set_stored(self, keys: Iterable[KeyEntry], teams: Iterable[TeamEntry]) -> None:
        self._stored = (tuple(keys), tuple(teams))
        self._join()

    def keys(self) -> list[KeyEntry]:
        """Every key, the config's first (for ``GET /admin/keys``)."""
        return [*self._config[0], *self._stored[0]]

    def teams(self) -> list[TeamEntry]:
        """Every team, the config's first (for ``GET /admin/teams``)."""
        return [*self._config[1], *self._stored[1]]

    def counts(self) -> dict[str, int]:
        """Keys by source (the ``llmgw_tenant_keys`` gauge)."""
        return {CONFIG: len(self._config[0]), API: len(self._stored[0])}

    def _join(self) -> None:
        teams: dict[str, Team] = {}
        for entry in (*self._stored[1], *self._config[1]):  # the config's team wins a name both have
            teams[entry.name] = entry.team()
        joined: dict[bytes, Tenant] = {}
        orphans = 0
        for key in (*self._stored[0], *self._config[0]):  # and the config's key a digest both have
            team = None
            if key.team is not None:
                team = teams.get(key.team)
                if team is None:  # its team is gone: refused rather than admitted without the team's limits
                    orphans += 1
                    continue
            joined[key.digest] = key.tenant(team)
        if orphans:
            log.warning("%d API key(s) name a team that does not exist; they are refused until the team is "
                        "created again", orphans)
        self._by_digest = joined
        self._require = self._require or bool(joined) or orphans > 0


# -- the config's keys, teams and prices ---------------------------------------------------------------------------

def limits_of(limits: TenantLimits, budgets: Iterable[BudgetConfig]) -> Limits:
    return Limits(rpm=limits.rpm, tpm=limits.tpm, concurrency=limits.concurrency,
                  budgets=tuple(Budget(b.period, b.tokens, None if b.usd is None else usd_to_nano(b.usd))
                                for b in budgets))


def config_team(team: TeamConfig) -> TeamEntry:
    return TeamEntry(team.name, limits_of(team.limits, team.budgets),
                     None if team.models is None else frozenset(team.models), team.priority, CONFIG,
                     priority_header=team.priority_header)


def config_key(api_key: ApiKey) -> KeyEntry:
    assert api_key.name is not None  # the config names every key (key-N)
    return KeyEntry(f"cfg-{api_key.name}", api_key.name, bytes.fromhex(api_key.sha256), api_key.team,
                    None if api_key.models is None else frozenset(api_key.models), api_key.priority,
                    limits_of(api_key.limits, api_key.budgets), CONFIG, priority_header=api_key.priority_header)


def config_entries(config: Config) -> tuple[list[KeyEntry], list[TeamEntry], bool]:
    """The config's keys and teams, and whether /v1 needs a key even without any (``tenancy.require_keys``):
    :meth:`Directory.set_config`'s arguments."""
    return [config_key(k) for k in config.api_keys], [config_team(t) for t in config.teams], \
        config.tenancy.require_keys


def build_directory(config: Config) -> Directory:
    """A directory of the config's keys and teams (a gateway adds its store's with :meth:`Directory.set_stored`)."""
    return Directory(*config_entries(config))


def build_prices(config: Config) -> PriceList:
    """The config's prices, in nano-dollars per token (USD per million tokens x 1,000)."""
    def per_token(usd_per_million: float) -> int:
        return usd_to_nano(usd_per_million) // 1_000_000

    return PriceList({p.model: Price(per_token(p.input), per_token(p.input if p.cached_input is None
                                                                    else p.cached_input), per_token(p.output))
                      for p in config.prices})


