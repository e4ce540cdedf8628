"""What a candidate's static replicas write to: the current term's published table and index, or nothing.

A candidate (``llmgw serve`` of a cluster without ``--role gateway``) runs
the config's static replicas (:class:`~llmgw.control.static.StaticReplicas`)
for its whole life, not per term, so that their KV-event subscriptions keep
up with the engines across elections and Redis outages: a new term starts
from a mirror that is already current (:meth:`TermKv.resync_all` asks each for
a full copy) instead of one that missed what the engines stored while there
was no leader.

While this process leads, :class:`TermTable` and :class:`TermKv` pass every
change to the current term's (:class:`~.term.LeaderTerm`)
:class:`~.writer.PublishedReplicaTable` and :class:`~.writer.PublishedKv`
(this process's table and index, and the cluster's log); while it follows,
and from the moment a term is over, changes are dropped (the leader's log
drives the table and index) and reads go to this process's own copies.
Before this process holds any copy of the cluster's state (Redis down at a
cold start), :class:`TermTable` routes the config's own static replicas
instead (fail-static from its own config): they are followed as if the
leader had published them, until the first snapshot replaces them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Protocol

from ..kv.changes import ChangesFields
from ..router.model import TierModel
from ..router.replica import Replica
from .writer import ResyncListeners, TableReads, replica_record

if TYPE_CHECKING:
    from ..kv.index import KvIndex
    from ..router.replicas import ReplicaSet
    from .follower import FollowedReplicas
    from .term import LeaderTerm
    from .writer import PublishedKv, PublishedReplicaTable

log = logging.getLogger(__name__)


class Leading(Protocol):
    """Where the term this process leads now is found (:attr:`SharedState.term <.state.SharedState.term>`)."""

    @property
    def term(self) -> "LeaderTerm | None": ...


class TermTable(TableReads):
    """A :class:`~llmgw.control.interfaces.ReplicaTable` that writes only while this process leads."""

    def __init__(self, inner: "ReplicaSet", leading: Leading, fallback: "FollowedReplicas | None" = None,
                 loaded: Callable[[], bool] = lambda: True):
        """``leading``: where the term this process leads now is found; ``fallback``: what this process follows,
        where the config's replicas go while ``loaded()`` is False (no copy of the cluster's state yet)."""
        self.inner = inner
        self._leading = leading
        self.fallback = fallback
        self.loaded = loaded
        self._told = False

    @property
    def term(self) -> "PublishedReplicaTable | None":
        term = self._leading.term
        return term.table if term is not None else None

    def _fail_static(self) -> "FollowedReplicas | None":
        """Following with no copy of the cluster's state: the followed replicas, which the config's seed."""
        if self.term is not None or self.loaded() or self.fallback is None:
            return None
        if not self._told:
            self._told = True
            log.warning("cluster state: no copy of the cluster's state yet (Redis unreachable, or no leader has "
                        "published one): this process routes its own config's static replicas meanwhile "
                        "(fail-static), until the first snapshot it loads replaces them")
        return self.fallback

    def declare_model(self, source: str, model: TierModel) -> None:
        if self.term is not None:
            self.term.declare_model(source, model)
        elif (fallback := self._fail_static()) is not None:
            fallback.declare(source, model)

    def withdraw_model(self, source: str, name: str) -> bool:
        if self.term is None and (fallback := self._fail_static()) is not None:
            fallback.withdraw(source, name)
        return self.term.withdraw_model(source, name) if self.term is not None else False

    def add(self, replica: Replica, source: str) -> bool:
        """False while following: the caller does not count it as added, and adds it again in the next term
        (with no copy of the cluster's state yet, a replica of its record is routed meanwhile)."""
        if self.term is None and (fallback := self._fail_static()) is not None:
            fallback.add(replica_record(replica, source))
        return self.term.add(replica, source) if self.term is not None else False

    async def remove(self, replica: Replica) -> None:
        if self.term is not None:
            await self.term.remove(replica)

    async def drain(self, replica: Replica, reason: str, timeout: float) -> None:
        if self.term is not None:
            await self.term.drain(replica, reason, timeout)


class TermKv(ResyncListeners):
    """A :class:`~llmgw.control.interfaces.KvWriter` that writes only while this process leads; its resync
    listeners (the static replicas' subscriptions) hear this process's index always."""

    def __init__(self, inner: "KvIndex", leading: Leading):
        self.inner = inner
        self._leading = leading
        self._listeners: list[Callable[[str, str, str], None]] = []

    @property
    def term(self) -> "PublishedKv | None":
        term = self._leading.term
        return term.kv if term is not None else None

    def apply(self, replica_id: str, changes: ChangesFields) -> None:
        if self.term is not None:
            self.term.apply(replica_id, changes)

    def forget(self, replica_id: str) -> None:
        if self.term is not None:
            self.term.forget(replica_id)

    def remove(self, replica_id: str) -> None:
        if self.term is not None:
            self.term.remove(replica_id)

    def resync_all(self, replica_ids: list[str], reason: str) -> None:
        """Ask each subscription for a full copy (at its next flush): a new term publishes the engines' truth."""
        for replica_id in replica_ids:
            self.remote_resync(replica_id, "full", reason)
