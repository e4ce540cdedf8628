"""``/admin/keys`` and ``/admin/teams`` on the control port: API keys and teams made, listed, changed, revoked.

A request body is read with the config's own rules (``api_keys[]`` and ``teams[]`` keys: llmgw.config.schema's
KeySpec, TeamConfig, TeamSpec), so a wrong value is refused with the same message as in the file. Keys and teams
of the config file are listed (``source: config``) and refused for change (409 ``defined_in_config``).
:func:`build_key_admin` makes the gateway's :class:`~llmgw.tenancy.keys.KeyAdmin` on its state backend's store.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from quart import Quart, jsonify, request

from ..cluster.records import Keys
from ..config.crosschecks import class_problem
from ..config.issues import ConfigError
from ..config.loading import read_json_object
from ..config.schema import KeySpec, TeamConfig, TeamSpec
from ..tenancy.directory import Directory
from ..tenancy.keys import AdminRefusal, KeyAdmin, StoreUnavailable, TenantKeyMetrics, key_json, team_json
from ..tenancy.store_redis import RedisKeyStore
from ..tenancy.store_sqlite import SqliteKeyStore, store_path

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from ..cluster.state import SharedState
    from ..config import Config
    from .app import Gateway

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 1 << 20  # a key with 10,000 model names fits


def build_key_admin(config: "Config", shared: "SharedState | None", directory: Directory,
                    registry: "CollectorRegistry") -> KeyAdmin:
    """The key admin of a gateway: SQLite in the state dir without a shared state, the cluster's Redis with one."""
    tenancy = config.tenancy
    store: SqliteKeyStore | RedisKeyStore
    if shared is None:
        store = SqliteKeyStore(store_path(config), max_keys=tenancy.max_keys, max_teams=tenancy.max_teams)
        where = f"SQLite {store.path}"
    else:
        store = RedisKeyStore(shared.link, Keys(config.state.cluster).prefix, shared.signer,
                              max_keys=tenancy.max_keys, max_teams=tenancy.max_teams)
        where = f"Redis {shared.link.address}"
    election = shared.election if shared is not None else None
    return KeyAdmin(store, directory, TenantKeyMetrics(registry), max_keys=tenancy.max_keys,
                    max_teams=tenancy.max_teams, describe=where,
                    may_resign=lambda: election is not None and election.leading)


def register_tenant_routes(app: Quart, gateway: "Gateway", error: Callable[..., Any],
                           json_object: Callable[[bytes | str, str], dict | str]) -> None:
    """Add the routes to the control app; ``error(status, message, code)`` answers in OpenAI's shape,
    ``json_object(raw, what)`` reads a body as a JSON object (or says why it is not one)."""

    async def answer(work: Awaitable[Any], status: int = 200) -> Any:
        try:
            return jsonify(await work), status
        except AdminRefusal as refusal:
            return error(refusal.status, refusal.message, refusal.code)
        except StoreUnavailable as exc:
            return error(503, f"the key store ({gateway.key_admin.describe}) cannot be used now: {exc}; "
                              "nothing was changed, try again", "key_store_unavailable")

    async def body(cls: type) -> Any:
        raw = await request.get_data(cache=False)
        if len(raw) > MAX_BODY_BYTES:
            raise AdminRefusal(413, "body_too_large", f"the body is larger than {MAX_BODY_BYTES} bytes")
        value = json_object(raw or b"{}", "the settings")
        if isinstance(value, str):
            raise AdminRefusal(400, "invalid_json", value)
        try:
            spec: KeySpec | TeamSpec = read_json_object(cls, value, "body")
        except ConfigError as exc:
            raise AdminRefusal(400, "invalid_settings",
                               "; ".join(f"{issue.key or 'body'}: {issue.message}" for issue in exc.errors)) from None
        problem = spec.priority and class_problem(spec.priority, gateway.config.flow.classes)
        if problem:
            raise AdminRefusal(400, "invalid_settings", f"priority: {problem}")
        return spec

    def admin() -> KeyAdmin:  # the gateway's, read at each call: the app may be built before (or without) it
        return gateway.key_admin

    async def list_keys() -> dict[str, Any]:
        return {"keys": admin().list_keys(), "store": admin().describe}

    async def show_key(ref: str) -> dict[str, Any]:
        return key_json(admin().key(ref))

    async def create_key(spec: KeySpec) -> dict[str, Any]:
        entry, secret = await admin().create_key(spec)
        return {**key_json(entry), "key": secret}  # the one answer that holds the key

    async def update_key(ref: str, spec: KeySpec) -> dict[str, Any]:
        return key_json(await admin().update_key(ref, spec))

    async def revoke_key(ref: str) -> dict[str, Any]:
        return {**key_json(await admin().revoke_key(ref)), "revoked": True}

    async def list_teams() -> dict[str, Any]:
        return {"teams": admin().list_teams(), "store": admin().describe}

    async def show_team(name: str) -> dict[str, Any]:
        return team_json(admin().team(name))

    async def create_team(spec: TeamConfig) -> dict[str, Any]:
        return team_json(await admin().create_team(spec))

    async def update_team(name: str, spec: TeamSpec) -> dict[str, Any]:
        return team_json(await admin().update_team(name, spec))

    async def delete_team(name: str) -> dict[str, Any]:
        return {**team_json(await admin().delete_team(name)), "deleted": True}

    for resource in (Resource("keys", KeySpec, KeySpec, list_keys, show_key, create_key, update_key, revoke_key),
                     Resource("teams", TeamConfig, TeamSpec, list_teams, show_team, create_team, update_team,
                              delete_team)):
        add_routes(app, resource, answer, body)


Answer = Awaitable[dict[str, Any]]


@dataclass(frozen=True)
class Resource:
    """One collection of the admin API (keys, teams): ``GET``/``POST /admin/NAME``, ``GET``/``PATCH``/``DELETE
    /admin/NAME/REF`` (REF: a key's id or name, a team's name)."""

    name: str
    create_body: type  # the config class a POST body is read as
    update_body: type  # and a PATCH body
    listing: Callable[[], Answer]
    show: Callable[[str], Answer]
    create: Callable[[Any], Answer]
    update: Callable[[str, Any], Answer]
    remove: Callable[[str], Answer]


def add_routes(app: Quart, resource: Resource, answer: Callable[..., Awaitable[Any]],
               body: Callable[[type], Awaitable[Any]]) -> None:
    """Register ``resource``'s five routes; ``answer(work, status)`` turns its result or refusal into a response,
    ``body(cls)`` reads the request's body as config class ``cls``."""
    path = f"/admin/{resource.name}"

    async def listing():
        return await answer(resource.listing())

    async def create():
        async def work() -> dict[str, Any]:
            return await resource.create(await body(resource.create_body))
        return await answer(work(), 201)

    async def show(ref: str):
        return await answer(resource.show(ref))

    async def update(ref: str):
        async def work() -> dict[str, Any]:
            return await resource.update(ref, await body(resource.update_body))
        return await answer(work())

    async def remove(ref: str):
        return await answer(resource.remove(ref))

    for rule, view, method in ((path, listing, "GET"), (path, create, "POST"), (path + "/<ref>", show, "GET"),
                               (path + "/<ref>", update, "PATCH"), (path + "/<ref>", remove, "DELETE")):
        app.add_url_rule(rule, f"{resource.name}_{view.__name__}", view, methods=[method])
