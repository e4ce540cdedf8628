"""The agent service: admits agents on ``/agent`` (or in-process) and owns one session per connected agent.

A connection's first message must be a Register carrying the join token
(``agents.token``, compared in constant time); anything else is answered with
``Registered(accepted=False)`` and closed, counted in
``llmgw_agent_refused_total{reason}`` and logged without the token. The
embedded agent's in-process channel is trusted (it is this process).

An :class:`AgentSession` owns, in its own nursery, a reader (every receive under
a deadline: silence past ``suspect_after`` makes the node suspect, past
``disconnected_after`` ends the session), a writer (the only task that sends,
fed through a bounded memory channel, so no send is ever cancelled mid-frame
by a producer) and a heartbeat. A second connection with the same node id
replaces the first, which is closed.

What the messages *mean* (shard reports, KV changes) is the business of the
``handler`` (the control plane); this module only moves them.
"""

from __future__ import annotations

import hmac
import logging
import time
from dataclasses import dataclass
from typing import Callable, Protocol

import trio

from .. import wire
from ..agent.channel import Channel, ChannelClosed
from .inventory import Inventory
from .tasks import TaskHost

log = logging.getLogger(__name__)

REFUSE_BAD_TOKEN = "bad_token"
REFUSE_NO_TOKEN = "no_token_configured"
REFUSE_PROTOCOL = "protocol"
REFUSE_TIMEOUT = "register_timeout"


@dataclass(frozen=True)
class SessionSettings:
    token: str | None = None
    heartbeat_interval: float = 5.0
    suspect_after: float = 15.0
    disconnected_after: float = 60.0
    register_timeout: float = 10.0
    close_timeout: float = 2.0
    outbox_size: int = 1024

    @classmethod
    def from_config(cls, agents) -> "SessionSettings":
        return cls(token=agents.token, heartbeat_interval=agents.heartbeat_interval,
                   suspect_after=agents.suspect_after, disconnected_after=agents.disconnected_after)


class SessionHandler(Protocol):
    """What the control plane does with sessions and their messages."""

    def on_register(self, session: "AgentSession", register: wire.Register) -> "AgentSession | None":
        """Record the node; return its previous live session (to be closed), if any."""

    def on_message(self, session: "AgentSession", message: wire.Message) -> None:
        """Any message after Register, except heartbeats."""

    def on_end(self, session: "AgentSession", reason: str) -> None:
        """The session is over."""


class AgentSession:
    """One agent connection, from its accepted Register to its end."""

    def __init__(self, service: "AgentService", channel: Channel, node_id: str, trusted: bool):
        self.service = service
        self.channel = channel
        self.node_id = node_id
        self.trusted = trusted
        self.peer = channel.peer
        self.end_reason = ""
        self._scope = trio.CancelScope()
        self._outbox_send, self._outbox_receive = trio.open_memory_channel(service.settings.outbox_size)
        self._last_heard = trio.current_time()
        self._suspect = False

    def post(self, message: wire.Message) -> bool:
        """Queue ``message`` for the agent without waiting; False when the session is over."""
        try:
            self._outbox_send.send_nowait(message)
            return True
        except trio.WouldBlock:
            self.close(f"the agent does not read: {self.service.settings.outbox_size} messages are waiting")
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass
        return False

    def close(self, reason: str) -> None:
        if not self.end_reason:
            self.end_reason = reason
        self._scope.cancel()

    async def run(self) -> None:
        with self._scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read)
                nursery.start_soon(self._write)
                nursery.start_soon(self._heartbeat)
        self._outbox_send.close()

    async def _read(self) -> None:
        settings = self.service.settings
        inventory = self.service.inventory
        while True:
            disconnect_at = self._last_heard + settings.disconnected_after
            if trio.current_time() >= disconnect_at:
                self.close(f"silent for {trio.current_time() - self._last_heard:.1f}s "
                           f"(agents.disconnected_after is {settings.disconnected_after:g}s)")
                return
            message = None
            with trio.move_on_at(disconnect_at if self._suspect else self._last_heard + settings.suspect_after):
                try:
                    message = await self.channel.receive()
                except ChannelClosed as exc:
                    self.close(f"connection closed ({exc})")
                    return
                except wire.WireError as exc:
                    self.service.refused(REFUSE_PROTOCOL, f"node {self.node_id}: undecodable frame skipped: {exc}")
                    message = exc
            if message is None:
                if not self._suspect:
                    self._suspect = True
                    inventory.mark_suspect(self.node_id, self,
                                           f"silent for {settings.suspect_after:g}s (agents.suspect_after)")
                continue
            self._last_heard = trio.current_time()
            self._suspect = False
            inventory.heard_from(self.node_id, self)
            if not isinstance(message, wire.WireError):
                self._dispatch(message)

    def _dispatch(self, message: wire.Message | wire.UnknownMessage) -> None:
        # An unknown type's name comes from the peer: never a label value (it would grow the series without bound).
        type_name = "unknown" if isinstance(message, wire.UnknownMessage) else type(message).__name__
        metrics = self.service.metrics
        if metrics is not None:
            metrics.agent_messages.labels(self.node_id, type_name).inc()
        if isinstance(message, wire.UnknownMessage):
            log.debug("node %s sent a message this version does not know (%.40r): skipped", self.node_id,
                      message.type_name)
        elif isinstance(message, wire.Heartbeat):
            pass
        elif isinstance(message, wire.Register):
            self.post(wire.ErrorMessage(code="already_registered", message="Register is only the first message"))
        else:
            try:
                self.service.handler.on_message(self, message)
            except Exception:  # a bug handling one message must not end every session of the process
                log.exception("node %s: handling a %s failed", self.node_id, type_name)

    async def _write(self) -> None:
        try:
            async for message in self._outbox_receive:
                await self.channel.send(message)
        except ChannelClosed as exc:
            self.close(f"connection closed ({exc})")

    async def _heartbeat(self) -> None:
        seq = 0
        while True:
            seq += 1
            self.post(wire.Heartbeat(seq=seq, sent_at=time.time()))
            await trio.sleep(self.service.settings.heartbeat_interval)


class AgentService(TaskHost):
    not_running = "the agent service is not running"

    def __init__(self, inventory: Inventory, handler: SessionHandler, settings: SessionSettings, *,
                 metrics=None, control_plane_id: str = ""):
        self.inventory = inventory
        self.handler = handler
        self.settings = settings
        self.metrics = metrics
        self.control_plane_id = control_plane_id

    async def accept_in_process(self, channel: Channel) -> None:
        """Serve the control plane's end of an in-process channel (the embedded agent), trusted."""
        self.spawn(self.serve, channel, True)  # its run() owns the sessions of in-process agents

    async def serve(self, channel: Channel, trusted: bool = False) -> None:
        """Run one connection from its Register to its end."""
        try:
            session = await self._admit(channel, trusted)
            if session is None:
                return
            try:
                await session.run()
            finally:
                reason = session.end_reason or "connection closed"
                log.info("session of node %s (%s) ended: %s", session.node_id, session.peer, reason)
                self.handler.on_end(session, reason)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(self.settings.close_timeout):
                await channel.aclose()

    async def _admit(self, channel: Channel, trusted: bool) -> AgentSession | None:
        settings = self.settings
        try:
            with trio.fail_after(settings.register_timeout):
                first = await channel.receive()
        except trio.TooSlowError:
            await self._refuse(channel, REFUSE_TIMEOUT, f"no Register within {settings.register_timeout:g}s")
            return None
        except ChannelClosed:
            return None
        except wire.WireError as exc:
            await self._refuse(channel, REFUSE_PROTOCOL, f"the first frame is not a message: {exc}")
            return None
        if not isinstance(first, wire.Register) or not first.node_id:
            await self._refuse(channel, REFUSE_PROTOCOL, "the first message must be a Register with a node id")
            return None
        if not trusted:
            if settings.token is None:
                await self._refuse(channel, REFUSE_NO_TOKEN, "this control plane admits no remote agents "
                                   "(agents.token is not set)", first.node_id)
                return None
            if not hmac.compare_digest(first.token.encode(), settings.token.encode()):
                await self._refuse(channel, REFUSE_BAD_TOKEN, "wrong join token", first.node_id)
                return None
        session = AgentSession(self, channel, first.node_id, trusted)
        session.post(wire.Registered(accepted=True, node_id=first.node_id,
                                     heartbeat_interval=settings.heartbeat_interval,
                                     control_plane_id=self.control_plane_id))
        log.info("node %s registered from %s (%d GPUs, %d running shards)", first.node_id, channel.peer,
                 len(first.gpus), len(first.shards))
        previous = self.handler.on_register(session, first)  # may queue refusals: after Registered
        if previous is not None and previous is not session:
            previous.close(f"replaced by a new connection from {channel.peer}")
        return session

    async def _refuse(self, channel: Channel, reason: str, message: str, node_id: str = "") -> None:
        self.refused(reason, f"refused {'node ' + node_id if node_id else 'a connection'} from {channel.peer}: "
                             f"{message}")
        try:
            with trio.move_on_after(self.settings.close_timeout):
                await channel.send(wire.Registered(accepted=False, reason=f"{reason}: {message}", node_id=node_id))
        except ChannelClosed:
            pass

    def refused(self, reason: str, message: str) -> None:
        """Count and log a refusal (never with the token)."""
        log.warning("%s", message)
        if self.metrics is not None:
            self.metrics.agent_refused.labels(reason).inc()


def send_error(session: AgentSession, code: str, message: str, about: str = "",
               count: Callable[[str, str], None] | None = None) -> None:
    """Tell the agent a message of its was refused (and count it)."""
    if count is not None:
        count(code, f"node {session.node_id}: {message}")
    session.post(wire.ErrorMessage(code=code, message=message, about=about))
