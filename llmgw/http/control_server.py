"""Serve the control app on Hypercorn so that no connection, request or session can end the process.

Hypercorn's own ``serve`` runs every connection in one nursery: an exception
escaping one connection (Hypercorn 0.18 raises ``trio.BusyResourceError`` when
a client half-closes in the middle of a request body while the app answers)
cancels every other connection, agent websockets included, and leaves the
server. Here the listening sockets are llmgw's, accepted connections are
handed to Hypercorn's per-connection ``TCPServer`` one by one, and:

- a connection that fails is logged and counted
  (``llmgw_control_connection_failures_total``); the others never notice;
- anything else that ends the server (its lifespan, an accept error) is
  logged, counted (``llmgw_control_server_restarts_total``) and the server is
  started again on the same listening sockets after a back-off, so the port
  never closes and clients queue in the backlog meanwhile.

Every connection has deadlines, as on the data port (:class:`ServerLimits`):
a request head must be complete within ``header_timeout`` (counted from accept
for a connection's first request, so one that sends nothing is closed then), its
body within ``body_timeout`` after the head, and an idle connection is closed
after ``keepalive_timeout`` (Hypercorn's own idle timer); a head or body too
slow is answered 408. The deadlines are read from the connection's HTTP/1.1
state (h11) before each read (:class:`_ReadDeadlines`); a connection upgraded to
a websocket has none (its own heartbeat governs it). The port speaks HTTP/1.0
and 1.1: another version is answered 505, and a connection that switches to
HTTP/2 (prior knowledge, ``Upgrade: h2c``) is closed. The port holds at most
``max_connections`` connections (:mod:`llmgw.http.connslots`: one more is answered
503 and closed); accept and connection errors are logged at most once per 10 s
with a count.
"""

from __future__ import annotations

import functools
import logging
import math
import socket
import ssl
from collections.abc import Callable
from typing import Any

import h11
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.protocol.h11 import H11Protocol, H11WSConnection
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, ASGIFramework, ConnectionState, Framework
from hypercorn.utils import wrap_app
from prometheus_client import CollectorRegistry, Counter

from ..lograte import RepeatLimitedLog
from .connslots import ConnectionMetrics, ConnectionSlots, accept_connections, canned_answer
from .listeners import bind_tcp, close_sockets
from .messages import error_body
from .server import ServerLimits

log = logging.getLogger(__name__)
repeats = RepeatLimitedLog(log)

_Stream = trio.SocketStream | trio.SSLStream[trio.SocketStream]
_VERSIONS = ("1.0", "1.1")
_TIMED_OUT = canned_answer(408, "Request Timeout", "request was not received in time")


class ControlServerMetrics:
    """The control port's own series, on the gateway's registry."""

    def __init__(self, registry: CollectorRegistry):
        self.restarts = Counter(
            "llmgw_control_server_restarts", "Times the control-port server failed as a whole and was started "
            "again (the error is logged).", registry=registry)
        self.connection_failures = Counter(
            "llmgw_control_connection_failures", "Control-port connections that ended in an error inside the "
            "server (contained: other connections and the process carry on).", registry=registry)
        self.auth_failures = Counter(
            "llmgw_admin_auth_failures", "Control-port requests refused for a missing or wrong admin token, by "
            "reason (missing, invalid).", ["reason"], registry=registry)


def hypercorn_config() -> HypercornConfig:
    config = HypercornConfig()
    config.accesslog = None
    config.errorlog = None
    config.graceful_timeout = 1.0
    config.websocket_ping_interval = 5.0
    # the largest agent frame, at the transport (the gateway sets it to agents.max_message_bytes; the agent
    # service refuses frames above 256KiB before a Register is accepted)
    config.websocket_max_message_size = 16 * 1024 * 1024
    config.ssl_handshake_timeout = 10.0
    return config


def apply_limits(config: HypercornConfig, limits: ServerLimits) -> None:
    """The data port's limits, where Hypercorn has a setting for them (the rest: :class:`_ReadDeadlines`)."""
    config.keep_alive_timeout = limits.keepalive_timeout
    config.h11_max_incomplete_size = limits.max_header_bytes
    config.ssl_handshake_timeout = limits.header_timeout


class ControlServer:
    """Serves one ASGI app on listeners it owns; see the module docstring for what is contained and how."""

    def __init__(self, app_factory: Callable[[], Framework], metrics: ControlServerMetrics, *,
                 ssl_context: ssl.SSLContext | None = None,
                 backoff: tuple[float, float] = (0.1, 5.0), healthy_after: float = 30.0,
                 limits: ServerLimits | None = None, connection_metrics: ConnectionMetrics | None = None):
        """``app_factory()`` makes the ASGI app: each life of the server gets a fresh one, so a restart never
        inherits the state a failure left behind. ``limits``: timeouts, head size and ``max_connections``;
        ``connection_metrics``: where the port's open, refused and timed-out connections are counted."""
        self.config = hypercorn_config()
        self.limits = limits or ServerLimits()
        apply_limits(self.config, self.limits)
        self.slots = ConnectionSlots("control", self.limits.max_connections, connection_metrics)
        self.app_factory = app_factory
        self.metrics = metrics
        self.ssl_context = ssl_context
        self.backoff = backoff
        self.healthy_after = healthy_after  # a run this long resets the back-off

    async def serve(self, host: str, port: int, *, shutdown: trio.Event,
                    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind ``host:port`` and serve until ``shutdown`` is set (or cancelled);
        ``task_status.started((host, bound_port))``."""
        sockets = await bind_tcp(host, port)
        try:
            task_status.started((host, sockets[0].getsockname()[1]))
            delay = self.backoff[0]
            while not shutdown.is_set():
                started = trio.current_time()
                try:
                    await self._run_once(sockets, shutdown)
                except Exception as exc:  # noqa: BLE001 - the whole point: log, count, serve again
                    self.metrics.restarts.inc()
                    if trio.current_time() - started >= self.healthy_after:
                        delay = self.backoff[0]
                    log.error("control server on %s:%s failed (%s); starting it again in %.1fs", host, port,
                              _describe(exc), delay, exc_info=exc)
                    with trio.move_on_after(delay):
                        await shutdown.wait()
                    delay = min(delay * 2, self.backoff[1])
        finally:
            close_sockets(sockets)

    async def _run_once(self, sockets: list[socket.socket], shutdown: trio.Event) -> None:
        """One life of the server: Hypercorn's lifespan, then accepting until ``shutdown``, then a graceful close
        (the same steps as ``hypercorn.trio.run.worker_serve``, with contained connections)."""
        app = wrap_app(_versions_checked(self.app_factory()), self.config.wsgi_max_body_size, None)
        lifespan_state: dict[str, Any] = {}
        lifespan = Lifespan(app, self.config, lifespan_state)
        context = WorkerContext(None)
        async with trio.open_nursery() as lifespan_nursery:
            await lifespan_nursery.start(lifespan.handle_lifespan)
            await lifespan.wait_for_startup()
            async with trio.open_nursery() as connections:
                def start(sock: socket.socket, _address: Any) -> None:
                    connections.start_soon(self._connection, app, sock, context, lifespan_state)

                async with trio.open_nursery() as accepting:
                    for sock in sockets:
                        accepting.start_soon(functools.partial(accept_connections, sock, self.slots, start,
                                                               answer_refused=self.ssl_context is None))
                    await shutdown.wait()
                    accepting.cancel_scope.cancel()
                await context.terminated.set()
                connections.cancel_scope.deadline = trio.current_time() + self.config.graceful_timeout
            await lifespan.wait_for_shutdown()
            lifespan_nursery.cancel_scope.cancel()

    async def _connection(self, app: AppWrapper, sock: socket.socket, context: WorkerContext,
                          lifespan_state: dict[str, Any]) -> None:
        plain = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        stream: _Stream = plain if self.ssl_context is None else trio.SSLStream(
            plain, self.ssl_context, server_side=True, https_compatible=True)
        guarded = _ReadDeadlines(stream, self.limits)
        try:
            server = _TCPServer(app, self.config, context, ConnectionState(lifespan_state.copy()),
                                guarded)  # type: ignore[arg-type]  # (annotated with SSL streams; serves any)
            guarded.server = server
            await server
        except Exception as exc:  # noqa: BLE001 - one connection's failure stays with it
            self.metrics.connection_failures.inc()
            repeats.warning("control port: a connection failed inside the server and was closed (%s)",
                            _describe(exc))
            log.debug("control port: connection failure", exc_info=exc)
        finally:  # Hypercorn's own close awaits before closing, so a cancelled connection would stay open
            self.slots.release()
            if guarded.expired is not None:
                self.slots.timed_out(guarded.expired)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)


class _TCPServer(TCPServer):
    """Hypercorn's connection, ended as soon as its reading ends: Hypercorn's own waits for its idle timer
    (``keep_alive_timeout``) first, holding the socket of a client that left or timed out that long."""

    async def _read_data(self) -> None:
        try:
            await super()._read_data()
        finally:
            await self.idle_task.stop()


class _ReadDeadlines:
    """A connection's stream for Hypercorn whose every read waits no longer than the HTTP/1.1 exchange allows.

    Before each read the connection's h11 state says the phase: no request yet or a head begun (``header``: the
    head must end ``header_timeout`` after the connection's accept, for its first request, else after the head's
    first byte), a head read and its body not (``body``: ``body_timeout`` after the head), a request being
    answered or an idle connection between requests (no read deadline here: Hypercorn's own idle timer closes a
    connection idle for ``keep_alive_timeout``), a websocket (none: its heartbeat governs it). A deadline that
    passes answers 408 when a request was begun and nothing was answered yet, and ends the connection.

    Hypercorn reads on while it answers, so the next request may arrive on a read begun for the previous one,
    with no idle state seen in between: what is not the next read's phase is forgotten at every read, so that a
    deadline always counts from its own request's bytes."""

    def __init__(self, stream: _Stream, limits: ServerLimits):
        self.stream = stream
        self.limits = limits
        self.server: TCPServer | None = None
        self.expired: str | None = None  # the phase whose deadline ended the connection
        self._head_from: float | None = trio.current_time()  # the accept: the first request's head counts from it
        self._body_from: float | None = None
        self._last_data_at = math.inf

    def __getattr__(self, name: str) -> Any:  # do_handshake, socket, transport_stream, send_all, aclose...
        return getattr(self.stream, name)

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        phase, deadline = self._deadline()
        with trio.move_on_at(deadline) as waiting:
            data = await self.stream.receive_some(max_bytes)
        if not waiting.cancelled_caught:
            self._last_data_at = trio.current_time()
            return data
        self.expired = phase
        await self._answer_timeout()
        raise trio.TooSlowError(f"no complete request {phase} in time")

    def _deadline(self) -> tuple[str, float]:
        """The phase and the deadline of the next read (inf: none)."""
        wrapper = getattr(self.server, "protocol", None)
        protocol = getattr(wrapper, "protocol", None)
        if protocol is None:
            return "header", self._header_deadline()
        if not isinstance(protocol, H11Protocol):
            raise trio.BrokenResourceError("the control port does not serve HTTP/2")
        connection = protocol.connection
        if isinstance(connection, H11WSConnection):
            return "websocket", math.inf
        state = connection.their_state
        if state is h11.IDLE:
            self._body_from = None
            if connection.trailing_data[0]:  # a head begun: from its first bytes (the first request's: the accept)
                if self._head_from is None:
                    self._head_from = self._last_data_at
            elif self._last_data_at != math.inf:
                # Between requests (a request read in one piece leaves no other state to see): Hypercorn's idle
                # timer governs the connection until the next head begins.
                self._head_from = None
            return "header", self._header_deadline()
        self._head_from = None
        if state is h11.SEND_BODY:
            if self._body_from is None:
                self._body_from = self._last_data_at  # the read that ended the head
            return "body", self._body_from + self.limits.body_timeout
        self._body_from = None
        return "answering", math.inf

    def _header_deadline(self) -> float:
        return math.inf if self._head_from is None else self._head_from + self.limits.header_timeout

    async def _answer_timeout(self) -> None:
        """408 to a client whose request was begun and not answered yet (best effort: the connection ends)."""
        wrapper = getattr(self.server, "protocol", None)
        connection = getattr(getattr(wrapper, "protocol", None), "connection", None)
        if not isinstance(connection, h11.Connection) or connection.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            return
        if connection.their_state is h11.IDLE and not connection.trailing_data[0]:
            return  # nothing was sent: close without a word, as the data port does
        assert self.server is not None
        with trio.move_on_after(1.0):
            async with self.server.send_lock:
                try:
                    await self.stream.send_all(_TIMED_OUT)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass


def _versions_checked(app: Framework) -> ASGIFramework:
    """``app`` behind a check of the HTTP version: 505 for anything but HTTP/1.0 and 1.1 (h11 takes any
    ``HTTP/d.d``: ``GET /health HTTP/9.9`` would be answered as 1.1)."""
    async def checked(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope.get("http_version") not in _VERSIONS:
            await send({"type": "http.response.start", "status": 505,
                        "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": error_body(
                505, f"HTTP/{scope.get('http_version')} is not supported: send HTTP/1.1 (or HTTP/1.0)")})
            return
        if scope["type"] == "websocket" and scope.get("http_version") not in _VERSIONS:
            await send({"type": "websocket.close", "code": 1002})
            return
        await app(scope, receive, send)  # type: ignore[call-arg, misc]  # (ASGI; WSGI is not served)

    return checked


def _describe(exc: BaseException) -> str:
    """``Type: message`` of the first real error inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"
