"""Whether a reloaded config may replace the running one, and what it would change.

A reload is all or nothing: :func:`refusal` says why a new config must not be
applied (then nothing changes), :func:`summarize` what it changes (logged,
and in ``POST /admin/reload``'s answer). Refused unless confirmed
(``allow_empty``): a file with no YAML document (empty, or being written), or
a config that removes every model and deployment. A config that removes some
applies (a SIGHUP could not confirm a routine removal), and the summary names
them. Refused always: a config that empties
``admin_tokens`` while the running one has some (opening ``/admin`` takes a
restart with ``allow_unauthenticated_admin``), one that empties ``api_keys``
while the running one has some (it would open ``/v1`` to everyone; that takes
a restart), or that leaves a non-loopback control port without tokens. docs/cluster.md#reload describes the rules.

An applied reload applies every setting that can change in a running process
(``api_keys`` and ``access_log`` included); :func:`restart_required` names the
settings (:data:`RESTART_KEYS`) whose new value waits for a restart, compared
with the config the process started with, so every later reload names them
again until a restart (or the file going back) clears them.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from ..cached_labels import CachedLabels
from ..config import Config
from .admin_guard import exposure_problem

# Settings read once, when the process starts (listeners, the server's limits, the health prober, logging, the
# shared state, the embedded agent): a reload that changes one says so in ``restart_required``.
RESTART_KEYS = (
    "listen", "control_listen", "data_tls", "control_tls", "state", "health", "log_level", "log_format",
    "limits.max_body_bytes", "limits.max_header_bytes", "limits.client_header_timeout", "limits.client_body_timeout",
    "limits.keepalive_timeout", "limits.max_connections", "limits.control_max_connections",
    "limits.connect_timeout", "agents.embedded", "agents.node_id", "agents.state_dir", "agents.control_state_dir",
    "agents.max_message_bytes", "agents.engine_ports", "tenancy.store", "tenancy.max_keys", "tenancy.max_teams",
)
_RESTART_VALUES = tuple(attrgetter(key) for key in RESTART_KEYS)
CONFIRM_HINT = "POST /admin/reload?allow_empty=true (or llmgw reload --allow-empty)"
APPLIED = "applied"


@dataclass(frozen=True)
class Changes:
    """What a reload does to one kind of entry, by name: added, removed, changed (same name, other settings)."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]
    before: int  # entries in the running config

    def describe(self, kind: str) -> str:
        """``models: added a, b; removed -; changed c``."""
        return f"{kind}: " + "; ".join(f"{what} {', '.join(names) or '-'}" for what, names in (
            ("added", self.added), ("removed", self.removed), ("changed", self.changed)))

    def to_json(self) -> dict[str, Any]:
        return {"added": list(self.added), "removed": list(self.removed), "changed": list(self.changed)}


@dataclass(frozen=True)
class KeyChanges:
    """How many secrets (API keys) a reload adds, removes and keeps, compared by value: counts, never names
    or keys (a renamed key is kept)."""

    added: int
    removed: int
    kept: int

    @classmethod
    def between(cls, old: list[str], new: list[str]) -> "KeyChanges":
        before, after = set(old), set(new)
        return cls(len(after - before), len(before - after), len(before & after))

    def describe(self, kind: str) -> str:
        return f"{kind}: added {self.added}, removed {self.removed}, kept {self.kept}"

    def to_json(self) -> dict[str, int]:
        return {"added": self.added, "removed": self.removed, "kept": self.kept}


@dataclass(frozen=True)
class ReloadSummary:
    """What applying a new config changes: models, deployments, how many admin and join tokens there are, and
    how many API keys it adds, removes and keeps."""

    models: Changes
    deployments: Changes
    admin_tokens: tuple[int, int]  # (before, after)
    join_tokens: tuple[int, int]
    api_keys: KeyChanges

    @property
    def removed(self) -> int:
        return len(self.models.removed) + len(self.deployments.removed)

    @property
    def before(self) -> int:
        return self.models.before + self.deployments.before

    def describe(self) -> str:
        """One line for the log: ``models: added -; removed a, b; changed -; deployments: ...; admin tokens 2 -> 1;
        join tokens 1 -> 1; API keys: added 1, removed 0, kept 2``."""
        return (f"{self.models.describe('models')}; {self.deployments.describe('deployments')}; "
                f"admin tokens {self.admin_tokens[0]} -> {self.admin_tokens[1]}; "
                f"join tokens {self.join_tokens[0]} -> {self.join_tokens[1]}; {self.api_keys.describe('API keys')}")

    def to_json(self) -> dict[str, Any]:
        """The counts of tokens, never the tokens."""
        return {"description": self.describe(), "models": self.models.to_json(),
                "deployments": self.deployments.to_json(),
                "admin_tokens": {"before": self.admin_tokens[0], "after": self.admin_tokens[1]},
                "join_tokens": {"before": self.join_tokens[0], "after": self.join_tokens[1]},
                "api_keys": self.api_keys.to_json()}


@dataclass(frozen=True)
class Refusal:
    """Why a reload is not applied: an HTTP status (409: conflicts with the running config; 422: the file is not a
    valid config), a short ``code`` (the metric's ``outcome`` and the OpenAI error's ``code``) and the messages."""

    status: int
    code: str
    errors: tuple[str, ...]

    @property
    def message(self) -> str:
        return "; ".join(self.errors)


@dataclass(frozen=True)
class ReloadOutcome:
    """What a reload did: applied (``refusal`` None) or not, and the changes it made or would have made (None when
    the file could not be read as a config)."""

    summary: ReloadSummary | None = None
    refusal: Refusal | None = None
    restart_required: tuple[str, ...] = ()  # settings whose value in the file waits for a restart

    @property
    def applied(self) -> bool:
        return self.refusal is None

    @property
    def errors(self) -> list[str]:
        return list(self.refusal.errors) if self.refusal else []

    def to_json(self) -> dict[str, Any]:
        """``POST /admin/reload``'s answer, less the OpenAI ``error`` object a refusal adds."""
        return {"reloaded": self.applied, "errors": self.errors,
                "summary": self.summary.to_json() if self.summary else None,
                "restart_required": list(self.restart_required)}


def _changes(old: dict[str, Any], new: dict[str, Any]) -> Changes:
    return Changes(added=tuple(name for name in new if name not in old),
                   removed=tuple(name for name in old if name not in new),
                   changed=tuple(name for name in new if name in old and old[name] != new[name]),
                   before=len(old))


def _deployments(config: Config) -> dict[str, Any]:
    """Each deployment by its profile's name (``name#2`` for a second one), with its profile: a changed profile
    restarts the deployment's engines, so it is a change of the deployment."""
    entries: dict[str, Any] = {}
    for deployment in config.deployments:
        key, n = deployment.profile, 1
        while key in entries:
            n += 1
            key = f"{deployment.profile}#{n}"
        profile = next((p for p in config.profiles if p.name == deployment.profile), None)
        entries[key] = (deployment, profile)
    return entries


def _join_tokens(config: Config) -> int:
    return (config.agents.token is not None) + len(config.agents.tokens)


def summarize(old: Config, new: Config) -> ReloadSummary:
    """What replacing the running config ``old`` by ``new`` changes."""
    return ReloadSummary(
        models=_changes({m.name: m for m in old.models}, {m.name: m for m in new.models}),
        deployments=_changes(_deployments(old), _deployments(new)),
        admin_tokens=(len(old.admin_tokens), len(new.admin_tokens)),
        join_tokens=(_join_tokens(old), _join_tokens(new)),
        api_keys=KeyChanges.between([k.sha256 for k in old.api_keys], [k.sha256 for k in new.api_keys]))


def restart_required(started: Config, new: Config) -> tuple[str, ...]:
    """The keys of :data:`RESTART_KEYS` whose value in ``new`` differs from the config the process ``started``
    with: what a reload of ``new`` leaves waiting for a restart."""
    return tuple(key for key, value in zip(RESTART_KEYS, _RESTART_VALUES) if value(started) != value(new))


def refusal(old: Config, new: Config, summary: ReloadSummary, *, blank: bool, allow_empty: bool,
            control_host: str) -> Refusal | None:
    """Why ``new`` (read from a file that was ``blank`` or not) must not replace ``old``, or None to apply it.
    ``allow_empty`` confirms a blank file and the removal of everything; nothing confirms weaker auth."""
    source = new.source
    if blank and not allow_empty:
        return Refusal(409, "empty_file", (
            f"{source} holds no YAML document (empty, or still being written): it would remove every model, "
            f"deployment and token; to apply it, {CONFIRM_HINT}",))
    if old.admin_tokens and not new.admin_tokens:
        return Refusal(409, "removes_admin_tokens", (
            f"{source}: admin_tokens is empty while the running config has {len(old.admin_tokens)}: a reload never "
            f"opens /admin; keep at least one token (opening it takes a restart with allow_unauthenticated_admin)",))
    if old.api_keys and not new.api_keys:
        return Refusal(409, "removes_api_keys", (
            f"{source}: api_keys is empty while the running config has {len(old.api_keys)}: it would open /v1 to "
            f"anyone who can reach the data port, so a reload never applies it (serving /v1 without keys takes a "
            f"restart with a config that has none)",))
    exposed = exposure_problem(control_host, new)
    if exposed:
        return Refusal(409, "exposes_admin", (exposed,))
    if allow_empty or not summary.removed or new.models or new.deployments:
        return None
    return Refusal(409, "removes_everything", (
        f"{source} has no models and no deployments: it would remove all {summary.before} of the running config "
        f"(a half-written file?); to apply it, {CONFIRM_HINT}",))


class ReloadMetrics:
    """``llmgw_config_reloads_total{outcome}``: ``applied``, or the refusal's code; and
    ``llmgw_config_restart_required``: how many settings of the config file wait for a restart."""

    def __init__(self, registry: CollectorRegistry):
        self.reloads = CachedLabels(Counter(
            "llmgw_config_reloads", "Config reloads (SIGHUP, POST /admin/reload) by outcome: applied, or why "
            "refused (invalid, no_config_file, empty_file, removes_admin_tokens, removes_api_keys, exposes_admin, "
            "removes_everything).", ["outcome"], registry=registry))
        self.restart_required = Gauge(
            "llmgw_config_restart_required", "Settings the last reload read that this process applies only at a "
            "restart (listed in the reload's restart_required); 0 when the running process is the file's.",
            registry=registry)

    def count(self, outcome: ReloadOutcome) -> None:
        self.reloads.labels(outcome.refusal.code if outcome.refusal else APPLIED).inc()
        self.restart_required.set(len(outcome.restart_required))
