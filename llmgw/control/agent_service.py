"""The agent service: admits agents on ``/agent`` (or in-process) and owns one session per connected agent.

A remote agent is checked twice. First at the websocket upgrade, before any
frame is read (:meth:`AgentService.upgrade`): its request must prove a join
token (``Authorization: Bearer``) or the node secret of a node that joined
before (``X-Llmgw-Node-Id`` and ``X-Llmgw-Node-Secret``), compared in constant
time, and fewer than ``agents.max_sessions`` websockets may be open; otherwise
it is answered 401, 403 or 503 with why, counted in
``llmgw_agent_upgrades_refused_total{reason}`` and logged (at most one line a
reason every 10 s). Then its first frame must be a Register of at most
:data:`~llmgw.wire.channel.MAX_REGISTER_BYTES`, within
``agents.register_timeout``; only then may frames be as large as
``agents.max_message_bytes``.

A connection's first message must be a Register. A node id that has joined
before must prove its node secret (:mod:`llmgw.control.identity`); a new one
must carry a join token (``agents.token`` or one of ``agents.tokens``,
compared in constant time), and is issued its node secret in the answer. Its
binding is stored once the agent speaks again (so a reply lost on the way does
not lock the node out); meanwhile nobody else can take that id. Anything else
is answered with ``Registered(accepted=False)`` and closed, counted in
``llmgw_agent_refused_total{reason}`` and logged with the peer's address and
without the token or secret. The embedded agent's in-process channel is
trusted (it is this process), and no remote agent can take its node id.

An :class:`AgentSession` owns, in its own nursery, a reader (every receive under
a deadline: silence past ``suspect_after`` makes the node suspect, past
``disconnected_after`` ends the session), a writer (the only task that sends,
fed through a bounded memory channel, so no send is ever cancelled mid-frame
by a producer) and a heartbeat. A second connection with the same node id
(which proved the node's secret) replaces the first, which is closed.

What the messages *mean* (shard reports, KV changes) is the business of the
``handler`` (the control plane); this module only moves them.
"""

from __future__ import annotations

import hmac
import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Protocol

import trio

from .. import __version__, wire
from ..logfields import log_fields
from ..lograte import RepeatLimitedLog
from ..wire.channel import MAX_FRAME_BYTES, AgentCredentials, Channel, ChannelClosed, FrameTooLarge
from .identity import MAX_NODE_ID, NodeIdentities, new_secret
from .inventory import Inventory
from .report_check import REFUSE_INVALID, ReportCheck
from .tasks import TaskHost

log = logging.getLogger(__name__)

REFUSE_BAD_TOKEN = "bad_token"
REFUSE_NO_TOKEN = "no_token_configured"
REFUSE_PROTOCOL = "protocol"
REFUSE_TIMEOUT = "register_timeout"
REFUSE_BAD_SECRET = "bad_node_secret"
REFUSE_RESERVED = "reserved_node_id"
REFUSE_NODE_LIMIT = "node_limit"
REFUSE_FRAME_TOO_LARGE = "frame_too_large"
# Reasons an upgrade to /agent is refused (llmgw_agent_upgrades_refused_total{reason}).
UPGRADE_NO_CREDENTIALS = "missing_token"
UPGRADE_BAD_CREDENTIALS = "bad_token"
UPGRADE_NO_TOKEN = "no_token_configured"
UPGRADE_SESSION_LIMIT = "session_limit"


@dataclass(frozen=True)
class SessionSettings:
    token: str | None = None
    tokens: tuple[str, ...] = ()  # more join tokens accepted beside ``token`` (rotation)
    reserved_node_ids: frozenset[str] = frozenset()  # the embedded agent's: never admitted from a remote session
    heartbeat_interval: float = 5.0
    suspect_after: float = 15.0
    disconnected_after: float = 60.0
    register_timeout: float = 5.0
    close_timeout: float = 2.0
    outbox_size: int = 1024
    max_sessions: int = 1024  # remote agent websockets open at once
    max_message_bytes: int = MAX_FRAME_BYTES  # the largest frame after the Register

    @classmethod
    def from_config(cls, agents) -> "SessionSettings":
        reserved = frozenset([agents.embedded_node_id]) if agents.embedded else frozenset()
        return cls(token=agents.token, tokens=tuple(agents.tokens), reserved_node_ids=reserved,
                   heartbeat_interval=agents.heartbeat_interval, suspect_after=agents.suspect_after,
                   disconnected_after=agents.disconnected_after, register_timeout=agents.register_timeout,
                   max_sessions=agents.max_sessions, max_message_bytes=agents.max_message_bytes)

    @property
    def join_tokens(self) -> tuple[str, ...]:
        return ((self.token,) if self.token is not None else ()) + self.tokens


@dataclass(frozen=True)
class UpgradeRefusal:
    """Why an upgrade to ``/agent`` is refused: the HTTP status, the metric's reason, and what the agent reads."""

    status: int
    reason: str
    message: str

    @property
    def headers(self) -> dict[str, str]:
        if self.status == 401:
            return {"WWW-Authenticate": 'Bearer realm="llmgw agents"'}
        if self.status == 503:
            return {"Retry-After": "5"}
        return {}


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
        self.pending_secret = ""  # issued to a new node, bound once it speaks again
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
            message: wire.Message | wire.UnknownMessage | wire.WireError | None = None
            with trio.move_on_at(disconnect_at if self._suspect else self._last_heard + settings.suspect_after):
                try:
                    message = await self.channel.receive()
                except ChannelClosed as exc:
                    self.close(f"connection closed ({exc})")
                    return
                except wire.WireError as exc:
                    reason = REFUSE_FRAME_TOO_LARGE if isinstance(exc, FrameTooLarge) else REFUSE_PROTOCOL
                    self.service.refused(reason, f"node {self.node_id}: undecodable frame skipped: {exc}")
                    message = exc
            if message is None:
                if not self._suspect:
                    self._suspect = True
                    inventory.mark_suspect(self.node_id, self,
                                           f"silent for {settings.suspect_after:g}s (agents.suspect_after)")
                continue
            self._last_heard = trio.current_time()
            self._suspect = False
            if self.pending_secret:
                self.service.joined(self)
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
                log.exception("node %s: handling a %s failed", self.node_id, type_name,
                              extra=log_fields(node=self.node_id))

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
                 identities: NodeIdentities, metrics=None, control_plane_id: str = "",
                 reports: ReportCheck | None = None):
        self.inventory = inventory
        self.handler = handler
        self.settings = settings
        self.identities = identities
        self.metrics = metrics
        self.control_plane_id = control_plane_id
        self.reports = reports or ReportCheck()
        self._joining: dict[str, AgentSession] = {}  # new node id -> the session its secret was issued on
        self.websockets = 0  # remote agent websockets open (admitted by upgrade(), until they end)
        self._warnings = RepeatLimitedLog(log)

    @contextmanager
    def upgrade(self, credentials: AgentCredentials, peer: str) -> Iterator[UpgradeRefusal | None]:
        """Decide on a websocket upgrade to ``/agent`` before it is accepted: yields ``None`` (serve it inside the
        block: it holds one of ``agents.max_sessions``) or the refusal to answer with (counted and logged)."""
        refusal = self._check_credentials(credentials)
        if refusal is None and self.websockets >= self.settings.max_sessions:
            refusal = UpgradeRefusal(503, UPGRADE_SESSION_LIMIT, f"{self.websockets} agent sessions are open, the "
                                     "most this control plane takes (agents.max_sessions): retry later")
        if refusal is not None:
            if self.metrics is not None:
                self.metrics.agent_upgrades_refused.labels(refusal.reason).inc()
            self._warnings.warning(f"refused an agent's websocket upgrade from {peer} (HTTP {refusal.status}, before "
                                   f"reading any frame): {refusal.message}", kind=f"upgrade {refusal.reason}")
            yield refusal
            return
        self._count_websockets(+1)
        try:
            yield None
        finally:
            self._count_websockets(-1)

    def _count_websockets(self, change: int) -> None:
        self.websockets += change
        if self.metrics is not None:
            self.metrics.agent_websockets.set(self.websockets)

    def _check_credentials(self, credentials: AgentCredentials) -> UpgradeRefusal | None:
        """The upgrade proves a join token, or the secret of a node that joined (or is joining); in constant time
        over every token. Which node id it may take is the Register's check (:meth:`_authenticate`)."""
        settings = self.settings
        if not settings.join_tokens:
            return UpgradeRefusal(403, UPGRADE_NO_TOKEN, "this control plane admits no remote agents "
                                  "(agents.token is not set)")
        if not credentials.present:
            return UpgradeRefusal(401, UPGRADE_NO_CREDENTIALS, "an agent proves its join token in the websocket "
                                  "upgrade (Authorization: Bearer TOKEN) since this version: upgrade llmgw-agent "
                                  f"to {__version__}, the control plane's")
        token_matched = False
        for token in settings.join_tokens:  # every one compared, in constant time
            token_matched |= hmac.compare_digest(credentials.token, token.encode())
        if token_matched or self._proves_secret(credentials):
            return None
        return UpgradeRefusal(401, UPGRADE_BAD_CREDENTIALS, "wrong join token (or node secret)")

    def _proves_secret(self, credentials: AgentCredentials) -> bool:
        if not credentials.node_secret:
            return False
        joining = self._joining.get(credentials.node_id)
        if joining is not None:
            return hmac.compare_digest(credentials.node_secret, joining.pending_secret.encode())
        return self.identities.verify(credentials.node_id, credentials.node_secret.decode("utf-8", "replace"))

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
                if self._joining.get(session.node_id) is session:
                    del self._joining[session.node_id]
                reason = session.end_reason or "connection closed"
                log.info("session of node %s (%s) ended: %s", session.node_id, session.peer, reason,
                         extra=log_fields(node=session.node_id))
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
        except FrameTooLarge as exc:
            await self._refuse(channel, REFUSE_FRAME_TOO_LARGE, f"the first frame is too large for a Register: {exc}")
            return None
        except wire.WireError as exc:
            await self._refuse(channel, REFUSE_PROTOCOL, f"the first frame is not a message: {exc}")
            return None
        if not isinstance(first, wire.Register) or not first.node_id:
            await self._refuse(channel, REFUSE_PROTOCOL, "the first message must be a Register with a node id")
            return None
        issued = ""
        if not trusted:
            refusal, issued = self._authenticate(first)
            if refusal is not None:
                await self._refuse(channel, refusal[0], refusal[1], first.node_id)
                return None
        problem = self.reports.register_problem(first)
        if problem is not None:
            await self._refuse(channel, REFUSE_INVALID, problem, first.node_id)
            return None
        session = AgentSession(self, channel, first.node_id, trusted)
        channel.max_frame_bytes = settings.max_message_bytes
        if issued:
            session.pending_secret = issued
            self._joining[first.node_id] = session
            log.info("node %s joins for the first time from %s with a join token: issued its node secret",
                     first.node_id, channel.peer, extra=log_fields(node=first.node_id))
        session.post(wire.Registered(accepted=True, node_id=first.node_id,
                                     heartbeat_interval=settings.heartbeat_interval,
                                     control_plane_id=self.control_plane_id, node_secret=issued))
        log.info("node %s registered from %s (%d GPUs, %d running shards)", first.node_id, channel.peer,
                 len(first.gpus), len(first.shards), extra=log_fields(node=first.node_id))
        previous = self.handler.on_register(session, first)  # may queue refusals: after Registered
        if previous is not None and previous is not session:
            previous.close(f"replaced by a new connection from {channel.peer}")
        return session

    def _authenticate(self, register: wire.Register) -> tuple[tuple[str, str] | None, str]:
        """``(None, secret to issue or "")`` for a remote Register that may open a session, else
        ``((reason, message), "")``."""
        settings = self.settings
        node_id = register.node_id
        if not settings.join_tokens:
            return (REFUSE_NO_TOKEN, "this control plane admits no remote agents (agents.token is not set)"), ""
        if len(node_id) > MAX_NODE_ID or not node_id.isprintable():
            return (REFUSE_PROTOCOL, f"a node id is at most {MAX_NODE_ID} printable characters"), ""
        node = self.inventory.nodes.get(node_id)
        if node_id in settings.reserved_node_ids or (node is not None and node.session is not None
                                                     and node.session.trusted):
            return (REFUSE_RESERVED, f"node id {node_id} is this control plane's embedded agent"), ""
        if self.identities.known(node_id):
            if self.identities.verify(node_id, register.node_secret):
                return None, ""
            return (REFUSE_BAD_SECRET, f"node id {node_id} has joined before and this agent does not prove its node "
                                       "secret (the node-secret file of its state dir); to give the id to a new "
                                       f"machine, forget it first: POST /admin/nodes/{node_id}/forget"), ""
        joining = self._joining.get(node_id)
        if joining is not None:
            if register.node_secret and hmac.compare_digest(register.node_secret.encode(),
                                                            joining.pending_secret.encode()):
                self.joined(joining)  # the same agent again: it kept the secret
                return None, ""
            return (REFUSE_BAD_SECRET, f"node id {node_id} is joining on another connection"), ""
        if self.identities.full or len(self._joining) >= self.identities.max_nodes:
            return (REFUSE_NODE_LIMIT, f"{self.identities.max_nodes} node identities are stored already: forget "
                                       "retired nodes (POST /admin/nodes/ID/forget)"), ""
        matched = False
        for token in settings.join_tokens:  # every one compared, in constant time
            matched |= hmac.compare_digest(register.token.encode(), token.encode())
        if not matched:
            return (REFUSE_BAD_TOKEN, "wrong join token"), ""
        return None, new_secret()

    def joined(self, session: AgentSession) -> None:
        """A new node's agent spoke after it was issued its secret (so it kept it): bind its id to it."""
        secret, session.pending_secret = session.pending_secret, ""
        if self._joining.get(session.node_id) is session:
            del self._joining[session.node_id]
        try:
            self.identities.bind(session.node_id, secret, session.peer)
        except OSError as exc:
            log.error("cannot store the identity of node %s in %s (%s): it joins again with the join token "
                      "next time", session.node_id, self.identities.path, exc)
            return
        log.info("node %s (%s) is bound to its node secret", session.node_id, session.peer,
                 extra=log_fields(node=session.node_id))

    def forget(self, node_id: str) -> bool:
        """Drop a node's identity (its id may join again with a join token) and close its remote session."""
        forgotten = self.identities.forget(node_id)
        joining = self._joining.pop(node_id, None)
        node = self.inventory.nodes.get(node_id)
        for session in (joining, node.session if node is not None else None):
            if session is not None and not session.trusted:
                session.close("its identity was forgotten (POST /admin/nodes/ID/forget)")
                forgotten = True
        if forgotten:
            log.warning("node %s: identity forgotten; the next agent with a join token takes the id", node_id,
                        extra=log_fields(node=node_id))
        return forgotten

    async def _refuse(self, channel: Channel, reason: str, message: str, node_id: str = "") -> None:
        self.refused(reason, f"refused {'node ' + node_id if node_id else 'a connection'} from {channel.peer}: "
                             f"{message}")
        try:
            with trio.move_on_after(self.settings.close_timeout):
                await channel.send(wire.Registered(accepted=False, reason=f"{reason}: {message}", node_id=node_id))
        except ChannelClosed:
            pass

    def refused(self, reason: str, message: str) -> None:
        """Count and log a refusal (never with the token; at most one line a reason every 10 s)."""
        self._warnings.warning(message, kind=reason)
        if self.metrics is not None:
            self.metrics.agent_refused.labels(reason).inc()


def send_error(session: AgentSession, code: str, message: str, about: str = "",
               count: Callable[[str, str], None] | None = None) -> None:
    """Tell the agent a message of its was refused (and count it)."""
    if count is not None:
        count(code, f"node {session.node_id}: {message}")
    session.post(wire.ErrorMessage(code=code, message=message, about=about))
