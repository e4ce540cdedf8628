"""Where a gateway keeps its usage: the store of its state backend and its journal's folder, from its config.

``state.backend: local``: the SQLite file ``tenancy.store`` (default ``tenancy.sqlite3`` in
``agents.control_state_dir``), the journal in ``<file name>.usage-journal/`` beside it. ``redis``: hourly hashes
in the cluster's Redis, the journal in ``usage-journal-<cluster>/`` in that same folder (a host's workers and
gateways of one cluster share the folder, each process with segments of its own).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from ..config import Config
from ..tenancy.store_sqlite import store_path
from ..tenancy.usage_redis import RedisUsageStore
from ..tenancy.usage_service import UsageService
from ..tenancy.usage_store import SqliteUsageStore, UsageStore

if TYPE_CHECKING:
    from ..cluster.state import SharedState


def usage_journal_dir(config: Config) -> Path:
    """The folder of this gateway's usage journal: beside the SQLite file, named for it or for the cluster."""
    store = store_path(config)
    if config.state.shared:
        return store.parent / f"usage-journal-{config.state.cluster}"
    return store.parent / f"{store.name}.usage-journal"


def build_usage(config: Config, registry: CollectorRegistry, shared: SharedState | None) -> UsageService:
    store: UsageStore
    if shared is not None:
        store = RedisUsageStore(shared.link, shared.keys)
    else:
        store = SqliteUsageStore(store_path(config))
    return UsageService(config.tenancy.settings(), store, usage_journal_dir(config), registry)
