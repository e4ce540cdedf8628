"""The inventory: every node that ever registered, its state, its session, and the shards it reports.

Node states:

- ``connected``: a session is open and the agent spoke within ``agents.suspect_after``;
- ``suspect``: the session is open but silent past ``suspect_after`` (commands still go out);
- ``disconnected``: no session (the connection closed, or stayed silent past
  ``agents.disconnected_after`` and was closed).

A node's shards are what its agent last said about them: the list in its
Register replaces what was known, each ShardStatus updates one. A disconnected
node keeps its last known shards: the engines most likely still run, and the
router keeps probing them; nothing here takes them out of routing.

The inventory only records. What to do about a node or a shard is the control
plane's business; it is told through ``on_change`` after every change.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import trio

from .. import wire

log = logging.getLogger(__name__)


class NodeState(str, enum.Enum):
    CONNECTED = "connected"
    SUSPECT = "suspect"
    DISCONNECTED = "disconnected"


@dataclass
class NodeRecord:
    node_id: str
    register: wire.Register  # as the agent sent it last, without its token
    state: NodeState = NodeState.CONNECTED
    state_reason: str = ""
    state_since: float = 0.0  # wall clock: when the session entered ``state``
    last_seen: float = 0.0  # trio clock
    registered_at: float = 0.0  # wall clock
    session: Any = None  # the live session (an AgentSession), None when disconnected
    session_serial: int = 0  # increases with every new session of this node
    shards: dict[str, wire.ShardReport] = field(default_factory=dict)
    unproven: set[str] = field(default_factory=set)  # reported shards without a valid placement proof: not adopted

    @property
    def reachable(self) -> bool:
        """A session is open: commands can be sent."""
        return self.session is not None and self.state is not NodeState.DISCONNECTED

    @property
    def address(self) -> str:
        return self.register.address


class Inventory:
    def __init__(self, *, on_change: Callable[[], None] | None = None, metrics=None):
        self.nodes: dict[str, NodeRecord] = {}
        self._on_change = on_change or (lambda: None)
        self._metrics = metrics
        self._serial = 0
        self.closing = False  # the gateway is stopping: sessions that end now are no news

    # -- sessions ------------------------------------------------------------------------------------------------

    def register(self, register: wire.Register, session: Any, unproven: Iterable[str] = ()) -> Any:
        """Record a (re)registration on ``session``; returns the node's previous live session, if any.
        ``unproven``: the ids of reported shards whose placement proof did not check out."""
        register = replace(register, token="", node_secret="")
        self._serial += 1
        node = self.nodes.get(register.node_id)
        previous = node.session if node is not None else None
        if node is None:
            node = self.nodes[register.node_id] = NodeRecord(register.node_id, register)
        node.register = register
        node.session = session
        node.session_serial = self._serial
        node.shards = {report.shard_id: report for report in register.shards}
        node.unproven = set(unproven)
        node.register.shards = []  # the shards live in node.shards from now on
        node.last_seen = trio.current_time()
        node.registered_at = time.time()
        node.state_since = 0.0  # a new session: connected since now, whatever the last one was
        self._set_state(node, NodeState.CONNECTED, f"registered with {len(node.shards)} running shards")
        self._changed()
        return previous

    def heard_from(self, node_id: str, session: Any) -> None:
        """Any message from the node's current session: it is alive."""
        node = self.nodes.get(node_id)
        if node is None or node.session is not session:
            return
        node.last_seen = trio.current_time()
        if node.state is NodeState.SUSPECT:
            self._set_state(node, NodeState.CONNECTED, "heard from it again")
            self._changed()

    def mark_suspect(self, node_id: str, session: Any, reason: str) -> None:
        node = self.nodes.get(node_id)
        if node is not None and node.session is session and node.state is NodeState.CONNECTED:
            self._set_state(node, NodeState.SUSPECT, reason)
            self._changed()

    def session_ended(self, node_id: str, session: Any, reason: str) -> None:
        """The session closed; the node is disconnected unless a newer session already replaced it."""
        node = self.nodes.get(node_id)
        if node is None or node.session is not session:
            return
        node.session = None
        self._set_state(node, NodeState.DISCONNECTED, reason)
        self._changed()

    def _set_state(self, node: NodeRecord, state: NodeState, reason: str) -> None:
        if node.state is not state or not node.state_reason:
            # The agent service logs each registration and session end; warn only about what goes wrong.
            level = logging.DEBUG if state is NodeState.CONNECTED or self.closing else logging.WARNING
            log.log(level, "node %s is %s: %s", node.node_id, state.value, reason)
        if node.state is not state or not node.state_since:
            node.state_since = time.time()
        node.state = state
        node.state_reason = reason
        if self._metrics is not None:
            self._metrics.set_node_counts(n.state.value for n in self.nodes.values())

    # -- shards --------------------------------------------------------------------------------------------------

    def update_shard(self, node_id: str, report: wire.ShardReport, proven: bool = True) -> None:
        node = self.nodes[node_id]
        before = node.shards.get(report.shard_id)
        node.shards[report.shard_id] = report
        if proven:
            node.unproven.discard(report.shard_id)
        else:
            node.unproven.add(report.shard_id)
        if before is None or before.state is not report.state:  # the agent that runs it logs it (once)
            log.debug("shard %s on %s is %s%s", report.shard_id, node_id, report.state.value,
                     f": {report.reason}" if report.reason else "")
        self._changed()

    def forget_shards(self, node_id: str, shard_ids: Iterable[str]) -> None:
        node = self.nodes.get(node_id)
        if node is None:
            return
        for shard_id in shard_ids:
            node.shards.pop(shard_id, None)
            node.unproven.discard(shard_id)
        self._update_shard_metrics()

    def shard(self, node_id: str, shard_id: str) -> wire.ShardReport | None:
        node = self.nodes.get(node_id)
        return node.shards.get(shard_id) if node is not None else None

    def all_shards(self) -> Iterable[tuple[str, wire.ShardReport]]:
        for node in self.nodes.values():
            for report in node.shards.values():
                yield node.node_id, report

    # -- views ---------------------------------------------------------------------------------------------------

    def node_json(self, node: NodeRecord, used_gpus: Iterable[int]) -> dict:
        """``wire`` Register fields (no token) plus ``state``, ``state_reason``, ``state_since`` (Unix time),
        ``used_gpus``, ``last_seen_s``."""
        body = wire.to_plain(node.register)
        body.pop("token", None)
        body.pop("node_secret", None)
        body["shards"] = [wire.to_plain(report) for report in node.shards.values()]
        for shard in body["shards"]:
            shard.pop("placement_proof", None)
        body["state"] = node.state.value
        body["state_reason"] = node.state_reason
        body["state_since"] = round(node.state_since, 3)
        body["used_gpus"] = sorted(set(used_gpus))
        body["last_seen_s"] = round(max(0.0, trio.current_time() - node.last_seen), 3)
        return body

    def _changed(self) -> None:
        self._update_shard_metrics()
        self._on_change()

    def _update_shard_metrics(self) -> None:
        if self._metrics is not None:
            self._metrics.set_shard_counts(report.state.value for _, report in self.all_shards())
