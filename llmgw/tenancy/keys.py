"""Keys and teams made by the admin API: create, list, update, revoke, and every gateway's copy of them.

:class:`KeyAdmin` is what ``/admin/keys`` and ``/admin/teams`` call. It writes through a :class:`KeyStore`
(:mod:`.store_sqlite` for ``state.backend: local``, :mod:`.store_redis` for a cluster) and keeps the gateway's
:class:`~.directory.Directory` following the store: :meth:`KeyAdmin.follow` asks the store's version every
``POLL_SECONDS`` and reads it again when it changed, so a key made or revoked on any gateway is in force on
every gateway within a second, without a reload. A new key is answered once; the store keeps its SHA-256 only.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge

from .directory import API, CONFIG, Directory, KeyEntry, TeamEntry, digest_of, limits_of
from .interfaces import StoreUnavailable
from .model import Limits, nano_to_usd

if TYPE_CHECKING:
    from ..config.schema import KeySpec, TeamConfig, TeamSpec

log = logging.getLogger(__name__)
POLL_SECONDS = 0.25  # how often a gateway asks the store's version: a change is in force everywhere within this
KEY_PREFIX = "sk-llmgw-"
RESIGN_BATCH = 100  # records re-signed in one pass (one write each), then the store is read again
RESIGN_EVERY = 1.0  # seconds between two passes (a record changed meanwhile is tried again at the next)


@dataclass(frozen=True)
class Stored:
    """What a store holds, read at once: its version, its keys and teams, and how many records it refused."""

    version: object
    keys: list[KeyEntry]
    teams: list[TeamEntry]
    refused: dict[str, int] = dataclasses.field(default_factory=dict)  # by kind: "key", "team"
    # records only the cluster's previous secret signed (a rotation), as the store re-signs them: KeyStore.resign
    resign: list[Any] = dataclasses.field(default_factory=list)


class NameTaken(Exception):
    """A write that claims a name another key (or team) holds in the store: nothing was written."""

    def __init__(self, kind: str, owner: str):
        super().__init__(f"{kind} {owner}")
        self.kind = kind  # "key" or "team"
        self.owner = owner  # the key id (or team name) holding it


class KeyStore(Protocol):
    """Where keys and teams are kept. A key's name is claimed atomically with its write (``new``, or
    ``renamed_from`` its old name, which is given up): :class:`NameTaken` when another key holds it; so is a new
    team's. Two gateways given one new name at once: one has it, the other is told."""

    async def version(self) -> object:
        """A value that changes with every write (cheap: asked every POLL_SECONDS)."""

    async def read(self) -> Stored: ...

    async def put_key(self, entry: KeyEntry, *, new: bool = False, renamed_from: str | None = None) -> None: ...

    async def delete_key(self, key_id: str, name: str | None = None) -> None: ...

    async def put_team(self, entry: TeamEntry, *, new: bool = False) -> None: ...

    async def delete_team(self, name: str) -> None: ...

    async def resign(self, records_read: list[Any]) -> int:
        """Write ``records_read`` (:attr:`Stored.resign`) again signed with the current secret, each only if it
        is unchanged since it was read; how many were written."""


class AdminRefusal(Exception):
    """An admin request that cannot be done: answered with ``status`` and an OpenAI-shaped error."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class TenantKeyMetrics:
    def __init__(self, registry: CollectorRegistry | None):
        self.keys = Gauge("llmgw_tenant_keys", "API keys this gateway accepts, by source (config: the file; api: "
                          "made by POST /admin/keys).", ["source"], registry=registry)
        self.teams = Gauge("llmgw_tenant_teams", "Teams this gateway knows, by source (config, api).", ["source"],
                           registry=registry)
        self.refused_records = Counter("llmgw_tenant_refused_records", "Key and team records of the key store "
                                       "refused when read (not signed with the cluster secret, malformed, larger "
                                       "or more than the admin API writes; replayed_key, replayed_team: older "
                                       "than their revocation or last change): never admitted.", ["kind"],
                                       registry=registry)
        self.previous_secret = Gauge("llmgw_tenant_previous_secret_records", "Key and team records, as this "
                                     "gateway last read them, that only the cluster's previous secret "
                                     "(state.previous_secret_env) signed: the leader re-signs them; drop that "
                                     "secret once this is 0.", registry=registry)
        self.changes = Counter("llmgw_tenant_key_changes", "Keys and teams created, updated and revoked through "
                               "this gateway's admin API.", ["kind", "change"], registry=registry)


class KeyAdmin:
    def __init__(self, store: KeyStore, directory: Directory, metrics: TenantKeyMetrics, *, max_keys: int,
                 max_teams: int, describe: str, may_resign: Callable[[], bool] = lambda: False):
        """``may_resign``: whether this process re-signs the records the cluster's previous secret signed (the
        cluster's leader: one process does it)."""
        self.store = store
        self.may_resign = may_resign
        self._resign: list[Any] = []
        self._resign_after = 0.0
        self.directory = directory
        self.metrics = metrics
        self.max_keys = max_keys
        self.max_teams = max_teams
        self.describe = describe  # where the store is, for log lines and /admin answers
        self._version: object = None
        self._read_once = False
        self._write_lock = trio.Lock()  # this process's writes one at a time (the checks see the last one)
        self._count()

    # -- following the store ------------------------------------------------------------------------------------

    async def follow(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the directory's stored keys as the store holds them, until cancelled. The first read is tried
        before ``task_status.started`` (a restarted gateway accepts its keys from its first request)."""
        failing = False
        started = False
        while True:
            try:
                await self.refresh()
                if self._resign and self.may_resign():
                    await self.resign()
                if failing:
                    log.info("key store %s: readable again; %d API keys", self.describe, len(self.directory.keys()))
                failing = False
            except Exception as exc:  # StoreUnavailable; anything else is a bug, and must not end the gateway
                if not failing:
                    log.warning("key store %s cannot be read (%s): the API keys as last read stay in force, and "
                                "changes made on other gateways wait until it can", self.describe, exc,
                                exc_info=not isinstance(exc, StoreUnavailable))
                failing = True
            if not started:
                started = True
                task_status.started()
            await trio.sleep(POLL_SECONDS)

    async def refresh(self, *, force: bool = False) -> None:
        """Read the store again if its version changed (or ``force``)."""
        version = await self.store.version()
        if not force and self._read_once and version == self._version:
            return
        stored = await self.store.read()
        for kind, count in stored.refused.items():
            self.metrics.refused_records.labels(kind).inc(count)
        if stored.refused and stored.version != self._version:
            log.error("key store %s: %s refused (not signed with the cluster secret, or malformed; replayed: older "
                      "than the revocation or the last change of its key or team): never admitted", self.describe,
                      ", ".join(f"{n} {kind} record(s)" for kind, n in stored.refused.items()))
        self.directory.set_stored(stored.keys, stored.teams)
        self._version, self._read_once = stored.version, True
        self._resign = stored.resign
        self.metrics.previous_secret.set(len(stored.resign))
        self._count()

    async def resign(self) -> None:
        """Re-sign what the cluster's previous secret signed alone, at most :data:`RESIGN_BATCH` records a pass
        (each written only if unchanged since it was read), then read the store back."""
        now = trio.current_time()
        if now < self._resign_after:
            return
        self._resign_after = now + RESIGN_EVERY
        batch = self._resign[:RESIGN_BATCH]
        async with self._write_lock:
            written = await self.store.resign(batch)
        if written:
            await self.refresh(force=True)
        log.info("key store %s: %d key and team record(s) signed with the previous cluster secret re-signed with "
                 "the current one, %d remain", self.describe, written, len(self._resign))

    def _count(self) -> None:
        for source, count in self.directory.counts().items():
            self.metrics.keys.labels(source).set(count)
        teams = self.directory.teams()
        for source in (CONFIG, API):
            self.metrics.teams.labels(source).set(sum(1 for t in teams if t.source == source))

    # -- keys --------------------------------------------------------------------------------------------------

    def list_keys(self) -> list[dict[str, Any]]:
        return [key_json(entry) for entry in self.directory.keys()]

    def key(self, ref: str) -> KeyEntry:
        """The key whose id (or name) is ``ref``; 404 otherwise."""
        for entry in self.directory.keys():
            if ref in (entry.key_id, entry.name):
                return entry
        raise AdminRefusal(404, "key_not_found", f"no API key has the id or name {ref!r}")

    async def create_key(self, spec: "KeySpec") -> tuple[KeyEntry, str]:
        """A new key from ``spec``, and its secret (never stored: answered once)."""
        if spec.name is None:
            raise AdminRefusal(400, "missing_name", "a new key needs a name (who holds it: logged, never secret)")
        async with self._write_lock:
            await self.refresh(force=True)
            self._check_name(spec.name, None)
            self._check_team(spec.team)
            if sum(1 for k in self.directory.keys() if k.source == API) >= self.max_keys:
                raise AdminRefusal(409, "too_many_keys", f"the key store holds tenancy.max_keys ({self.max_keys}) "
                                   "keys: revoke some, or raise the bound")
            secret = KEY_PREFIX + secrets.token_urlsafe(32)
            entry = KeyEntry(f"k-{secrets.token_hex(8)}", spec.name, digest_of(secret), spec.team,
                             _models(spec.models), spec.priority, limits_of(spec.limits, spec.budgets), API,
                             round(time.time(), 3), spec.priority_header)
            await self._write(self.store.put_key(entry, new=True))
        self.metrics.changes.labels("key", "created").inc()
        log.info("API key created: name=%s id=%s team=%s", entry.name, entry.key_id, entry.team or "-")
        return entry, secret

    async def update_key(self, ref: str, spec: "KeySpec") -> KeyEntry:
        """Change what ``spec`` writes (name, team, models, priority, limits, budgets) of an API-made key."""
        async with self._write_lock:
            await self.refresh(force=True)
            entry = previous = self._editable(self.key(ref), "key")
            changes: dict[str, Any] = {}
            if spec.was_written("name") and spec.name is not None:
                self._check_name(spec.name, entry.key_id)
                changes["name"] = spec.name
            if spec.was_written("team"):
                self._check_team(spec.team)
                changes["team"] = spec.team
            if spec.was_written("models"):
                changes["models"] = _models(spec.models)
            changes.update(_priority_changes(spec))
            changes["limits"] = _updated_limits(entry.limits, spec)
            entry = dataclasses.replace(entry, **changes)
            renamed_from = previous.name if entry.name != previous.name else None
            await self._write(self.store.put_key(entry, renamed_from=renamed_from))
        self.metrics.changes.labels("key", "updated").inc()
        log.info("API key updated: name=%s id=%s team=%s", entry.name, entry.key_id, entry.team or "-")
        return entry

    async def revoke_key(self, ref: str) -> KeyEntry:
        """Delete an API-made key: refused from the next request on every gateway (within a second)."""
        async with self._write_lock:
            await self.refresh(force=True)
            entry = self._editable(self.key(ref), "key")
            await self._write(self.store.delete_key(entry.key_id, entry.name))
        self.metrics.changes.labels("key", "revoked").inc()
        log.info("API key revoked: name=%s id=%s team=%s", entry.name, entry.key_id, entry.team or "-")
        return entry

    # -- teams -------------------------------------------------------------------------------------------------

    def list_teams(self) -> list[dict[str, Any]]:
        return [team_json(entry) for entry in self.directory.teams()]

    def team(self, name: str) -> TeamEntry:
        for entry in self.directory.teams():
            if entry.name == name:
                return entry
        raise AdminRefusal(404, "team_not_found", f"no team is named {name!r}")

    async def create_team(self, spec: "TeamConfig") -> TeamEntry:
        async with self._write_lock:
            await self.refresh(force=True)
            if any(t.name == spec.name for t in self.directory.teams()):
                raise AdminRefusal(409, "team_exists", f"a team named {spec.name!r} exists")
            if sum(1 for t in self.directory.teams() if t.source == API) >= self.max_teams:
                raise AdminRefusal(409, "too_many_teams", f"the key store holds tenancy.max_teams "
                                   f"({self.max_teams}) teams: delete some, or raise the bound")
            entry = TeamEntry(spec.name, limits_of(spec.limits, spec.budgets), _models(spec.models), spec.priority,
                              API, round(time.time(), 3), spec.priority_header)
            await self._write(self.store.put_team(entry, new=True))
        self.metrics.changes.labels("team", "created").inc()
        log.info("team created: name=%s", entry.name)
        return entry

    async def update_team(self, name: str, spec: "TeamSpec") -> TeamEntry:
        async with self._write_lock:
            await self.refresh(force=True)
            entry = self._editable(self.team(name), "team")
            changes: dict[str, Any] = {"limits": _updated_limits(entry.limits, spec)}
            if spec.was_written("models"):
                changes["models"] = _models(spec.models)
            changes.update(_priority_changes(spec))
            entry = dataclasses.replace(entry, **changes)
            await self._write(self.store.put_team(entry))
        self.metrics.changes.labels("team", "updated").inc()
        log.info("team updated: name=%s", entry.name)
        return entry

    async def delete_team(self, name: str) -> TeamEntry:
        async with self._write_lock:
            await self.refresh(force=True)
            entry = self._editable(self.team(name), "team")
            members = [k.name for k in self.directory.keys() if k.team == name]
            if members:
                raise AdminRefusal(409, "team_has_keys", f"team {name!r} still has {len(members)} key(s) "
                                   f"({', '.join(members[:5])}{', ...' if len(members) > 5 else ''}): revoke them "
                                   "or move them to another team first")
            await self._write(self.store.delete_team(name))
        self.metrics.changes.labels("team", "deleted").inc()
        log.info("team deleted: name=%s", name)
        return entry

    # -- checks ------------------------------------------------------------------------------------------------

    async def _write(self, write: Any) -> None:
        """Await one store write, then read the store back (this gateway has the change at once). A name another
        gateway claimed in the same instant is refused as if this one had read it (409)."""
        try:
            await write
        except NameTaken as taken:
            await self.refresh(force=True)
            if taken.kind == "key":
                raise AdminRefusal(409, "key_name_taken", f"another key ({taken.owner}) took this name a moment "
                                   "ago: names are unique, they label logs and usage") from None
            raise AdminRefusal(409, "team_exists", f"a team named {taken.owner!r} was made a moment ago") from None
        try:
            await self.refresh(force=True)
        except StoreUnavailable:
            pass  # written; follow() reads it as soon as it can

    def _check_name(self, name: str, key_id: str | None) -> None:
        for entry in self.directory.keys():
            if entry.name == name and entry.key_id != key_id:
                raise AdminRefusal(409, "key_name_taken", f"a key named {name!r} exists ({entry.key_id}, source "
                                   f"{entry.source}): names are unique, they label logs and usage")

    def _check_team(self, team: str | None) -> None:
        if team is not None and not any(t.name == team for t in self.directory.teams()):
            raise AdminRefusal(404, "team_not_found", f"no team is named {team!r}: create it first "
                               "(POST /admin/teams) or name one under teams in the config")

    @staticmethod
    def _editable(entry: Any, kind: str) -> Any:
        if entry.source == CONFIG:
            raise AdminRefusal(409, "defined_in_config", f"the {kind} {entry.name!r} is defined in the config "
                               "file: change it there and reload")
        return entry


def _models(models: list[str] | None) -> frozenset[str] | None:
    return None if models is None else frozenset(models)


def _updated_limits(limits: Limits, spec: "KeySpec | TeamSpec") -> Limits:
    """``limits`` with what ``spec`` writes: each of rpm, tpm and concurrency written under ``limits`` (null:
    unlimited), and ``budgets`` as a whole when written."""
    written = limits_of(spec.limits, spec.budgets)
    return Limits(
        rpm=written.rpm if spec.limits.was_written("rpm") else limits.rpm,
        tpm=written.tpm if spec.limits.was_written("tpm") else limits.tpm,
        concurrency=written.concurrency if spec.limits.was_written("concurrency") else limits.concurrency,
        budgets=written.budgets if spec.was_written("budgets") else limits.budgets)


def _priority_changes(spec: "KeySpec | TeamSpec") -> dict[str, Any]:
    """What an update writes of a key's or a team's priority: its class, whether the header may raise it."""
    return {name: getattr(spec, name) for name in ("priority", "priority_header") if spec.was_written(name)}


def _limits_json(limits: Limits) -> dict[str, Any]:
    return {"limits": {"rpm": limits.rpm, "tpm": limits.tpm, "concurrency": limits.concurrency},
            "budgets": [{"period": b.period, "tokens": b.tokens,
                         "usd": None if b.nano_usd is None else nano_to_usd(b.nano_usd)} for b in limits.budgets]}


def key_json(entry: KeyEntry) -> dict[str, Any]:
    """A key as the admin API lists it: never the key, nor its hash."""
    return {"id": entry.key_id, "name": entry.name, "team": entry.team,
            "models": None if entry.models is None else sorted(entry.models), "priority": entry.priority,
            "priority_header": entry.priority_header, **_limits_json(entry.limits), "source": entry.source,
            "created": entry.created or None}


def team_json(entry: TeamEntry) -> dict[str, Any]:
    return {"name": entry.name, "models": None if entry.models is None else sorted(entry.models),
            "priority": entry.priority, "priority_header": entry.priority_header, **_limits_json(entry.limits),
            "source": entry.source, "created": entry.created or None}
