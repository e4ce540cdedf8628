"""``/admin/keys`` and ``/admin/teams`` on the control port: API keys and teams made, listed, changed, revoked.

A request body is read with the config's own rules (``api_keys[]`` and ``teams[]`` keys: llmgw.config.schema's
KeySpec, TeamConfig, TeamSpec), so a wrong value is refused with the same message as in the file. Keys and teams
of the config file are listed (``source: config``) and refused for change (409 ``defined_in_config``).
:func:`build_key_admin` makes the gateway's :class:`~llmgw.tenancy.keys.KeyAdmin` on its state backend's store.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from quart import Quart, jsonify, request

from ..cluster.records import Keys
from ..config.issues import ConfigError
from ..config.loading import read_json_object
from ..config.schema import KeySpec, TeamConfig, TeamSpec
from ..tenancy.directory import Directory
from ..tenancy.keys import AdminRefusal, KeyAdmin, StoreUnavailable, TenantKeyMetrics, key_json, team_json
from ..tenancy.store_redis import RedisKeyStore
from ..tenancy.store_sqlite import SqliteKeyStore, default_store_path

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
        path = default_store_path(config.agents.control_state_dir) if tenancy.store is None else tenancy.store
        store = SqliteKeyStore(Path(path), max_keys=tenancy.max_keys, max_teams=tenancy.max_teams)
        where = f"SQLite {store.path}"
    else:
        store = RedisKeyStore(shared.link, Keys(config.state.cluster).prefix, shared.signer,
                              max_keys=tenancy.max_keys, max_teams=tenancy.max_teams)
        where = f"Redis {shared.link.address}"
    return KeyAdmin(store, directory, TenantKeyMetrics(registry), max_keys=tenancy.max_keys,
                    max_teams=tenancy.max_teams, describe=where)


def register_tenant_routes(app: Quart, gateway: "Gateway", error: Callable[..., Any],
                           json_object: Callable[[bytes | str, str], dict | str]) -> None:
    """Add the routes to the control app; ``error(status, message, code)`` answers in OpenAI's shape,
    ``json_object(raw, what)`` reads a body as a JSON object (or says why it is not one)."""

    async def answer(work: Callable[[], Any], status: int = 200) -> Any:
        try:
            return jsonify(await work()), status
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
            return read_json_object(cls, value, "body")
        except ConfigError as exc:
            raise AdminRefusal(400, "invalid_settings",
                               "; ".join(f"{issue.key or 'body'}: {issue.message}" for issue in exc.errors)) from None

    @app.get("/admin/keys")
    async def list_keys():
        """Every API key (the config's and the admin API's): never a key, nor its hash."""
        return jsonify({"keys": gateway.key_admin.list_keys(), "store": gateway.key_admin.describe})

    @app.post("/admin/keys")
    async def create_key():
        """A new key: answered once with ``key`` (the store keeps its SHA-256 only)."""
        async def work() -> dict[str, Any]:
            entry, secret = await gateway.key_admin.create_key(await body(KeySpec))
            return {**key_json(entry), "key": secret}
        return await answer(work, 201)

    @app.get("/admin/keys/<ref>")
    async def get_key(ref: str):
        async def work() -> dict[str, Any]:
            return key_json(gateway.key_admin.key(ref))
        return await answer(work)

    @app.patch("/admin/keys/<ref>")
    async def update_key(ref: str):
        async def work() -> dict[str, Any]:
            return key_json(await gateway.key_admin.update_key(ref, await body(KeySpec)))
        return await answer(work)

    @app.delete("/admin/keys/<ref>")
    async def revoke_key(ref: str):
        async def work() -> dict[str, Any]:
            return {**key_json(await gateway.key_admin.revoke_key(ref)), "revoked": True}
        return await answer(work)

    @app.get("/admin/teams")
    async def list_teams():
        return jsonify({"teams": gateway.key_admin.list_teams(), "store": gateway.key_admin.describe})

    @app.post("/admin/teams")
    async def create_team():
        async def work() -> dict[str, Any]:
            return team_json(await gateway.key_admin.create_team(await body(TeamConfig)))
        return await answer(work, 201)

    @app.get("/admin/teams/<name>")
    async def get_team(name: str):
        async def work() -> dict[str, Any]:
            return team_json(gateway.key_admin.team(name))
        return await answer(work)

    @app.patch("/admin/teams/<name>")
    async def update_team(name: str):
        async def work() -> dict[str, Any]:
            return team_json(await gateway.key_admin.update_team(name, await body(TeamSpec)))
        return await answer(work)

    @app.delete("/admin/teams/<name>")
    async def delete_team(name: str):
        async def work() -> dict[str, Any]:
            return {**team_json(await gateway.key_admin.delete_team(name)), "deleted": True}
        return await answer(work)
