"""The transport between an agent and the control plane: one ``Channel`` interface, two implementations.

A :class:`Channel` carries :mod:`llmgw.wire` message objects both ways.

- :class:`FrameChannel` encodes them into websocket frames: the agent's
  trio-websocket client (:func:`websocket_channel`) and the control plane's
  Quart websocket (:func:`quart_channel`).
- :class:`MemoryChannel` hands them over trio memory channels: the embedded
  agent of ``llmgw serve``. Messages are copied on the way, so neither side can
  change what the other holds (as with a real wire).

Both sessions, the agent's and the control plane's, are written against
``Channel`` alone, so the embedded agent runs exactly the code a remote one
runs. Rules for users of a channel: only one task sends (cancelling a
websocket send mid-frame poisons the connection), every ``receive`` is made
under a deadline by the caller, and a lost peer shows up as
:class:`ChannelClosed` from either call.

An agent reaches the control plane through a *connector*:
:class:`WebSocketConnector` dials ``ws://HOST:PORT/agent`` (or ``wss://``,
trusting the server as :class:`llmgw.tls.TlsClientOptions` say), proving its
:class:`AgentCredentials` in the upgrade request's headers, so that the control
plane reads no frame of a peer it does not know; :class:`InProcessConnector`
hands a fresh memory channel pair to the in-process agent service.

A frame channel refuses a frame above its ``max_frame_bytes`` without decoding
it: the control plane keeps that at :data:`MAX_REGISTER_BYTES` until the
agent's Register is accepted, then raises it to ``agents.max_message_bytes``.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import ssl
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping, Protocol
from urllib.parse import urlsplit, urlunsplit

import trio

from ..fdpressure import capacity_errno, note_shortage
from ..tls import TlsClientOptions, client_context, describe_tls_error
from . import messages as wire
from .liveness import DEFAULT_HEARTBEAT, dial_timeout

log = logging.getLogger(__name__)

AGENT_PATH = "/agent"
MAX_FRAME_BYTES = 16 * 1024 * 1024  # a full KV mirror can be large (agents.max_message_bytes, its default)
# The largest first frame (the Register) of an agent: a 16-GPU node's Register is 19 KiB, with 112 running
# shards 67 KiB; the agent leaves its shards' log tails out of a Register that would be larger.
MAX_REGISTER_BYTES = 256 * 1024

# How long an agent waits for the answer to its websocket close: a peer that answers at all does so within it; a
# frozen one never does, and the agent's next dial (to another control plane, maybe) waits for this.
CLOSE_TIMEOUT = 0.5

NODE_ID_HEADER = "X-Llmgw-Node-Id"
NODE_SECRET_HEADER = "X-Llmgw-Node-Secret"


class ChannelClosed(Exception):
    """The peer went away (or the channel was closed on this side)."""


class DialFailed(ConnectionError):
    """No channel could be opened to ``url``: the message says why (never a bare exception name)."""

    def __init__(self, url: str, why: str):
        super().__init__(f"{url}: {why}")
        self.url = url


class FrameTooLarge(wire.WireError):
    """A frame above the channel's ``max_frame_bytes``: refused unread."""


class UpgradeRefused(Exception):
    """The control plane refused the websocket upgrade: its HTTP ``status`` and message. 401 and 403 are final
    (the credentials, or this control plane, will not change by retrying); others (503: too many sessions) pass."""

    def __init__(self, status: int, message: str, leader: str | None = None):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.leader = leader  # a cluster's candidate that does not lead names the leader's control URL

    @property
    def final(self) -> bool:
        return self.status in (401, 403)


@dataclass(frozen=True)
class AgentCredentials:
    """What an agent proves in its websocket upgrade: the join token (``Authorization: Bearer``) and, once the
    node has joined, its node id and secret (``X-Llmgw-Node-Id``, ``X-Llmgw-Node-Secret``). Values are compared
    as the bytes sent (UTF-8)."""

    token: bytes = field(default=b"", repr=False)
    node_id: str = ""
    node_secret: bytes = field(default=b"", repr=False)

    @classmethod
    def of(cls, register: wire.Register) -> "AgentCredentials":
        return cls(register.token.encode(), register.node_id, register.node_secret.encode())

    def headers(self) -> list[tuple[bytes, bytes]]:
        headers = []
        if self.token:
            headers.append((b"authorization", b"Bearer " + self.token))
        if self.node_secret:
            headers += [(NODE_ID_HEADER.lower().encode(), self.node_id.encode()),
                        (NODE_SECRET_HEADER.lower().encode(), self.node_secret)]
        return headers

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> "AgentCredentials":
        """From an upgrade request's headers, as the server decoded them (Latin-1: back to the bytes sent)."""
        scheme, _, token = (headers.get("authorization") or "").strip().partition(" ")
        node_id = (headers.get(NODE_ID_HEADER) or "").encode("latin-1", "replace").decode("utf-8", "replace")
        return cls(token.strip().encode("latin-1", "replace") if scheme.lower() == "bearer" else b"", node_id,
                   (headers.get(NODE_SECRET_HEADER) or "").strip().encode("latin-1", "replace"))

    @property
    def present(self) -> bool:
        return bool(self.token or self.node_secret)


class Channel(Protocol):
    peer: str  # who is at the other end, for logs
    max_frame_bytes: int  # the largest frame receive takes (frame channels; in-process ones carry no frames)

    async def send(self, message: wire.Message) -> None:
        """Send one message; raises :class:`ChannelClosed` when the peer is gone."""

    async def receive(self) -> wire.Message | wire.UnknownMessage:
        """The next message; raises :class:`ChannelClosed` at the end, :class:`llmgw.wire.WireError` on garbage."""

    async def aclose(self) -> None:
        """Close this end (idempotent)."""


class FrameChannel:
    """Messages as msgpack websocket frames, over any transport that moves whole frames."""

    def __init__(self, send_frame: Callable[[bytes], Awaitable[None]], receive_frame: Callable[[], Awaitable[object]],
                 close: Callable[[], Awaitable[None]], peer: str, closed_errors: tuple[type[BaseException], ...],
                 max_frame_bytes: int = MAX_FRAME_BYTES):
        self.peer = peer
        self.max_frame_bytes = max_frame_bytes
        self._send_frame = send_frame
        self._receive_frame = receive_frame
        self._close = close
        self._closed_errors = closed_errors + (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
        self._closed = False

    async def send(self, message: wire.Message) -> None:
        frame = wire.encode(message)
        try:
            await self._send_frame(frame)
        except self._closed_errors as exc:
            raise ChannelClosed(f"{self.peer}: {exc or type(exc).__name__}") from None

    async def receive(self) -> wire.Message | wire.UnknownMessage:
        try:
            frame = await self._receive_frame()
        except self._closed_errors as exc:
            raise ChannelClosed(f"{self.peer}: {exc or type(exc).__name__}") from None
        if not isinstance(frame, (bytes, bytearray)):
            raise wire.WireError("a text frame: agent messages are binary msgpack frames")
        if len(frame) > self.max_frame_bytes:
            raise FrameTooLarge(f"a frame of {len(frame)} bytes (at most {self.max_frame_bytes} here)")
        return wire.decode(bytes(frame))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._close()
        except Exception as exc:  # best effort: the peer may be gone, or the server closing the socket already
            log.debug("closing the channel to %s: %r", self.peer, exc)


def websocket_channel(ws: Any, peer: str) -> FrameChannel:
    """A channel over a trio-websocket connection (the agent's side)."""
    from trio_websocket import ConnectionClosed

    return FrameChannel(ws.send_message, ws.get_message, ws.aclose, peer, (ConnectionClosed,))


def quart_channel(websocket: Any, peer: str) -> FrameChannel:
    """A channel over a Quart websocket (the control plane's side), taking frames up to
    :data:`MAX_REGISTER_BYTES` until its owner raises ``max_frame_bytes``.

    Quart cancels the handler when the client disconnects; a send after that
    fails with a transport error, reported as :class:`ChannelClosed`.
    """

    async def close() -> None:
        await websocket.close(1000)

    return FrameChannel(websocket.send, websocket.receive, close, peer, (ConnectionError, RuntimeError),
                        max_frame_bytes=MAX_REGISTER_BYTES)


class MemoryChannel:
    """One end of an in-process channel: message objects over trio memory channels."""

    def __init__(self, send_channel: trio.MemorySendChannel[wire.Message],
                 receive_channel: trio.MemoryReceiveChannel[wire.Message], peer: str):
        self.peer = peer
        self.max_frame_bytes = MAX_FRAME_BYTES  # not enforced: objects, not frames, cross an in-process channel
        self._send = send_channel
        self._receive = receive_channel

    async def send(self, message: wire.Message) -> None:
        try:
            await self._send.send(copy.deepcopy(message))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise ChannelClosed(f"{self.peer}: closed") from None

    async def receive(self) -> wire.Message | wire.UnknownMessage:
        try:
            return await self._receive.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError, trio.BrokenResourceError):
            raise ChannelClosed(f"{self.peer}: closed") from None

    async def aclose(self) -> None:
        await self._send.aclose()
        await self._receive.aclose()


def memory_channel_pair(agent_name: str = "embedded agent", buffer: int = 64) -> tuple[MemoryChannel, MemoryChannel]:
    """``(agent_end, control_plane_end)`` of a new in-process channel."""
    to_control_send, to_control_receive = trio.open_memory_channel[wire.Message](buffer)
    to_agent_send, to_agent_receive = trio.open_memory_channel[wire.Message](buffer)
    return (MemoryChannel(to_control_send, to_agent_receive, "control plane (in-process)"),
            MemoryChannel(to_agent_send, to_control_receive, agent_name))


# -- connectors: how an agent opens a channel -------------------------------------------------------------------------


class Connector(Protocol):
    @property
    def url(self) -> str:
        """Where it connects (now), for logs."""

    def connect(self, credentials: AgentCredentials) -> AbstractAsyncContextManager[Channel]:
        """An async context manager yielding a fresh channel to the control plane (:class:`UpgradeRefused` when
        it refuses ``credentials`` at the door, :class:`DialFailed` when nothing answers the upgrade)."""

    def skip(self) -> None:
        """The last channel's peer went silent: dial another of its URLs first, if it has several (a frozen
        process accepts the TCP connection and holds the upgrade until the connect timeout)."""

    def heartbeat(self, interval: float) -> None:
        """The control plane heartbeats every ``interval`` (its ``Registered`` said): a dial waits
        :func:`~llmgw.wire.liveness.dial_timeout` of it from now on."""


LEADER_HEADER = "X-Llmgw-Leader"  # on a refused upgrade: where the cluster's leader is (its control URL)


def agent_url(join: str) -> str:
    """The websocket URL of the agent service from what an operator typed.

    ``http://cp:8001``, ``ws://cp:8001``, ``cp:8001`` and the full ``ws://cp:8001/agent``
    all give ``ws://cp:8001/agent`` (``https``/``wss`` give ``wss``).
    """
    text = join.strip()
    if "://" not in text:
        text = "ws://" + text
    parts = urlsplit(text)
    scheme = {"http": "ws", "ws": "ws", "https": "wss", "wss": "wss"}.get(parts.scheme)
    if scheme is None or not parts.hostname:
        raise ValueError(f"not a control-plane URL: {join!r} (expected http://HOST:PORT or ws://HOST:PORT)")
    path = parts.path.rstrip("/") or AGENT_PATH
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


class WebSocketConnector:
    """Dials the control plane's agent websocket; over TLS for a ``wss://`` (or ``https://``) URL."""

    def __init__(self, join: str, connect_timeout: float | None = None, tls: TlsClientOptions | None = None):
        """``connect_timeout``: fixed (tests), else :func:`~llmgw.wire.liveness.dial_timeout` of the heartbeat
        interval (the default one until a ``Registered`` says: :meth:`heartbeat`)."""
        self.url = agent_url(join)
        self.fixed_timeout = connect_timeout is not None
        self.connect_timeout = connect_timeout if connect_timeout is not None else dial_timeout(DEFAULT_HEARTBEAT)
        self.ssl_context: ssl.SSLContext | None = None
        if self.url.startswith("wss://"):
            self.ssl_context = client_context(tls)  # OSError/ssl.SSLError: a CA or key file that cannot be used
        elif tls is not None:
            raise ValueError(f"TLS options need a wss:// (or https://) control-plane URL, not {self.url}")

    @asynccontextmanager
    async def connect(self, credentials: AgentCredentials) -> AsyncIterator[Channel]:
        from trio_websocket import ConnectionRejected, ConnectionTimeout, HandshakeError

        # trio-websocket's own connect_timeout does not end a dial whose peer took the TCP connection and never
        # answers (a frozen process: its reader task keeps the dial open): this deadline does.
        with trio.CancelScope(deadline=trio.current_time() + self.connect_timeout) as dialling:
            async with AsyncExitStack() as stack:
                try:
                    ws = await self._open(stack, credentials)
                except ConnectionTimeout:
                    dialling.deadline = math.inf  # the dial is over; the diagnosis has a deadline of its own
                    raise await self._unanswered() from None
                except ConnectionRejected as exc:
                    leader = {name.lower(): value for name, value in exc.headers or ()}.get(
                        LEADER_HEADER.lower().encode())
                    raise UpgradeRefused(exc.status_code, _refusal_message(exc.body),
                                         leader.decode("latin-1")[:2048] if leader else None) from None
                except HandshakeError as exc:  # trio-websocket's wrapper of the connect's OSError, mostly
                    raise DialFailed(self.url, str(exc.__cause__ or "") or str(exc) or
                                     f"the websocket upgrade failed ({type(exc).__name__})") from exc
                except OSError as exc:
                    if isinstance(exc, ssl.SSLError):
                        raise
                    raise DialFailed(self.url, str(exc) or type(exc).__name__) from exc
                dialling.deadline = math.inf  # connected: the session has deadlines of its own
                yield websocket_channel(ws, f"control plane {self.url}")
        if dialling.cancelled_caught:
            raise await self._unanswered()

    async def _open(self, stack: AsyncExitStack, credentials: AgentCredentials) -> Any:
        """The websocket, entered on ``stack``; a shortage of descriptors is counted and logged (the agent backs
        off; a DialFailed keeps the error as its cause, so the failover connector sees it too)."""
        from trio_websocket import open_websocket_url

        try:
            return await stack.enter_async_context(open_websocket_url(
                self.url, ssl_context=self.ssl_context, connect_timeout=self.connect_timeout,
                disconnect_timeout=CLOSE_TIMEOUT, max_message_size=MAX_FRAME_BYTES,
                extra_headers=credentials.headers()))
        except Exception as exc:
            if capacity_errno(exc) is not None:  # this process is out of descriptors; the agent backs off
                note_shortage("agent_link", exc, self.url)
            raise

    async def _unanswered(self) -> DialFailed:
        """Why the upgrade got no answer in time: a TLS handshake that failed (raised as :class:`ssl.SSLError`), or
        a peer that said nothing."""
        if self.ssl_context is not None:
            await self._diagnose_tls()
        return DialFailed(self.url, f"no answer to the websocket upgrade within {self.connect_timeout:g}s (a frozen "
                                    "or overloaded process, or not an llmgw control port)")

    def skip(self) -> None:
        pass  # one URL: it is the only one to dial

    def heartbeat(self, interval: float) -> None:
        if not self.fixed_timeout:
            self.connect_timeout = dial_timeout(interval)

    async def _diagnose_tls(self) -> None:
        """trio-websocket reports a failed TLS handshake as a timeout: try one to say what is wrong (a certificate
        the CA file does not vouch for, most often)."""
        parts = urlsplit(self.url)
        with trio.move_on_after(self.connect_timeout):
            try:
                stream = await trio.open_ssl_over_tcp_stream(parts.hostname or "", parts.port or 443,
                                                             ssl_context=self.ssl_context)
                async with stream:
                    await stream.do_handshake()
            except (OSError, trio.BrokenResourceError) as exc:
                cause = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) and exc.__cause__ else exc
                raise ssl.SSLError(f"{self.url}: {describe_tls_error(cause)}") from cause


class FailoverConnector:
    """Several control listeners of one cluster (``llmgw agent --join URL,URL``): one is dialled at a time, the
    next after a failure to connect or a refusal. A candidate that does not lead refuses with the leader's URL
    (:data:`LEADER_HEADER`): the agent goes there next if it is one of its own URLs, and never anywhere else
    (its join token and node secret go only where the operator said)."""

    def __init__(self, connectors: list[WebSocketConnector]):
        if not connectors:
            raise ValueError("no control-plane URL to join")
        self.connectors = connectors
        self.current = 0

    @property
    def url(self) -> str:
        return self.connectors[self.current].url

    def heartbeat(self, interval: float) -> None:
        for connector in self.connectors:
            connector.heartbeat(interval)

    @asynccontextmanager
    async def connect(self, credentials: AgentCredentials) -> AsyncIterator[Channel]:
        connected = False
        try:
            async with self.connectors[self.current].connect(credentials) as channel:
                connected = True
                yield channel
        except BaseException as exc:
            if not connected:
                self._move_on(exc)
            raise

    def skip(self) -> None:
        self.current = (self.current + 1) % len(self.connectors)

    def _move_on(self, exc: BaseException) -> None:
        if capacity_errno(exc) is not None:  # no socket to dial with: no fault of this URL, tried again next
            return
        leader = exc.leader if isinstance(exc, UpgradeRefused) else None
        if leader:
            try:
                wanted = agent_url(leader)
            except ValueError:
                wanted = ""
            for index, connector in enumerate(self.connectors):
                if connector.url == wanted:
                    self.current = index
                    return
        self.skip()


class InProcessConnector:
    """Hands the control plane's end of a new memory channel to ``accept`` (the in-process agent service)."""

    def __init__(self, accept: Callable[[Channel], Awaitable[None]], agent_name: str = "embedded agent"):
        self.url = "in-process"
        self._accept = accept
        self._agent_name = agent_name

    @asynccontextmanager
    async def connect(self, credentials: AgentCredentials) -> AsyncIterator[Channel]:
        agent_end, control_end = memory_channel_pair(self._agent_name)
        await self._accept(control_end)
        try:
            yield agent_end
        finally:
            await agent_end.aclose()

    def skip(self) -> None:
        pass  # this process: the only one there is

    def heartbeat(self, interval: float) -> None:
        pass  # no dial


def _refusal_message(body: bytes | None) -> str:
    """``code: message`` of a refused upgrade's answer (an OpenAI-style JSON error), or its first 300 characters."""
    text = (body or b"").decode("utf-8", "replace")
    try:
        error = json.loads(text)["error"]
        message = f"{error['code']}: {error['message']}" if error.get("code") else str(error["message"])
    except (ValueError, KeyError, TypeError, AttributeError):
        message = text
    return message[:300] or "no reason given"
