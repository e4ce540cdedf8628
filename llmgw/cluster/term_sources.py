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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

from ..kv.changes import ChangesFields
from ..router.model import TierModel
from ..router.replica import Replica
from .writer import ResyncListeners, TableReads

if TYPE_CHECKING:
    from ..kv.index import KvIndex
    from ..router.replicas import ReplicaSet
    from .term import LeaderTerm
    from .writer import PublishedKv, PublishedReplicaTable


class Leading(Protocol):
    """Where the term this process leads now is found (:attr:`SharedState.term <.state.SharedState.term>`)."""

    @property
    def term(self) -> "LeaderTerm | None": ...


class TermTable(TableReads):
    """A :class:`~llmgw.control.interfaces.ReplicaTable` that writes only while this process leads."""

    def __init__(self, inner: "ReplicaSet", leading: Leading):
        self.inner = inner
        self._leading = leading

    @property
    def term(self) -> "PublishedReplicaTable | None":
        term = self._leading.term
        return term.table if term is not None else None

    def declare_model(self, source: str, model: TierModel) -> None:
        if self.term is not None:
            self.term.declare_model(source, model)

    def withdraw_model(self, source: str, name: str) -> bool:
        return self.term.withdraw_model(source, name) if self.term is not None else False

    def add(self, replica: Replica, source: str) -> bool:
        """False while following: the caller does not count it as added, and adds it again in the next term."""
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
