"""One term of this process as its cluster's leader: the one object that owns what only a leader runs.

:class:`LeaderTerm` is opened by :class:`~.state.SharedState` when its
:class:`~.election.Election` wins a lease (:class:`~.election.Term`: the
generation, the fencing token and the cancel scope), and owns one nursery,
inside that scope, where everything of the term runs: the log writer, the
answers to followers' resync asks, the hold of the previous leader's replicas,
and the gateway's control plane, with every agent session it admitted (an
accepted ``/agent`` websocket is served in the control plane's agent service,
whose nursery is inside this one) and the embedded agent.

The rest of the process reaches the writer, the published table and index,
and the control plane only through :attr:`SharedState.term
<.state.SharedState.term>`, which is None from the moment the term is over
(its lease expired or was taken, a write was fenced), before its tasks have
even unwound. So the end of a term ends, and hides, everything it ran: no
session, command or write of a dead term reaches anyone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Awaitable, Callable

import trio

from .election import Term

if TYPE_CHECKING:
    from ..agent.agent import Agent
    from ..control.plane import ControlPlane
    from .writer import LogWriter, PublishedKv, PublishedReplicaTable


class LeaderTerm:
    """A won term's parts, all living in :attr:`nursery` (inside the lease's scope) and ending with it."""

    def __init__(self, lease: Term, writer: "LogWriter", table: "PublishedReplicaTable", kv: "PublishedKv",
                 nursery: trio.Nursery):
        self.lease = lease
        self.writer = writer
        self.table = table  # what the control plane's sources write to: this process's table and the cluster's log
        self.kv = kv
        self.nursery = nursery
        self.started_at = trio.current_time()
        self.control: ControlPlane | None = None  # the gateway's, from the moment it runs in this term
        self.embedded_agent: Agent | None = None

    @property
    def generation(self) -> int:
        return self.lease.generation

    @property
    def over(self) -> bool:
        return self.lease.over

    async def start(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run ``fn`` in the term's nursery (``nursery.start``: it reports when it is up)."""
        return await self.nursery.start(fn, *args)

    def start_soon(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        self.nursery.start_soon(fn, *args)
