"""What the replica sources (the control plane, the static models) need from the router side, as protocols.

:class:`ReplicaTable` is implemented in-process by
:class:`llmgw.router.replicas.ReplicaSet`; :class:`KvWriter` by
:class:`llmgw.kv.index.KvIndex`. A version backed by a shared store (several
gateways sharing one replica table and one KV index) implements the same
methods: membership and declarations written to the store, each process's
pools, probers and tiers built from what it reads back (docs/architecture.md, "Where state lives").
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

from ..kv.changes import ChangesFields
from ..router.model import TierModel
from ..router.replica import Replica

if TYPE_CHECKING:
    from .plane import ControlPlane


class ReplicaTable(Protocol):
    def declare_model(self, source: str, model: TierModel) -> None:
        """``source`` serves ``model`` (routed with its tier)."""

    def withdraw_model(self, source: str, name: str) -> bool:
        """``source`` no longer serves ``name``; True when no source does (the model is gone)."""

    def model(self, name: str) -> TierModel | None:
        """The model as routed, or None when no source declares it."""

    def declared_models(self) -> list[str]:
        """Every model some source declares."""

    def add(self, replica: Replica, source: str) -> bool:
        """Route to ``replica`` (of a declared model); False when it cannot be (logged)."""

    async def remove(self, replica: Replica) -> None:
        """Stop routing to ``replica`` at once."""

    async def drain(self, replica: Replica, reason: str, timeout: float) -> None:
        """No new requests to ``replica``; removed once its in-flight ones finished (or after ``timeout``)."""

    def members(self, model: str) -> list[Replica]:
        """The replicas of ``model``."""

    def source_of(self, replica: Replica) -> str | None:
        """``static`` or ``deployed``; None when ``replica`` is not in the table."""

    def describe(self, replica: Replica) -> dict:
        """The replica's JSON for the admin API, with its ``source``."""


class KvWriter(Protocol):
    def apply(self, replica_id: str, changes: ChangesFields) -> None:
        """An engine's KV-cache changes (DELTA, FULL or RESET) for the replica it serves."""

    def forget(self, replica_id: str) -> None:
        """The stream feeding this replica's entries was lost: they are not trusted until a FULL copy."""

    def remove(self, replica_id: str) -> None:
        """The replica left for good: drop its entries."""

    def add_resync_listener(self, listener: Callable[[str, str, str], None]) -> None:
        """``listener(replica_id, mode, reason)`` when the index of a replica drifted and wants a resync."""

    def remove_resync_listener(self, listener: Callable[[str, str, str], None]) -> None:
        """Undo :meth:`add_resync_listener`."""


class ReplicaCounter(Protocol):
    """What sets the replica count of the deployments it scales instead of their config's ``replicas``
    (llmgw.autoscale's :class:`~llmgw.autoscale.actuator.Autoscaler`, on the leader)."""

    def counts(self, control: "ControlPlane") -> Mapping[str, int]:
        """The replicas to run now, by profile name, for each deployment it scales (others: the config's)."""

    def retire_reason(self, profile: str, count: int) -> str:
        """Why a replica of ``profile`` beyond ``count`` is retired (the Retire's reason, logged)."""

    def keep_warm(self, control: "ControlPlane", profile: str) -> float:
        """Seconds a scaled-down replica of ``profile`` keeps its engine, unrouted, for a hot start (0: none)."""

    def describe(self, control: "ControlPlane") -> dict[str, Any]:
        """Its state as ``/admin/autoscale`` shows it."""

    async def run(self, control: "ControlPlane", *, task_status: Any = ...) -> None:
        """Its loop, in the control plane's nursery (it ends with the control plane's term)."""
