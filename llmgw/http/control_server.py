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
"""

from __future__ import annotations

import errno
import logging
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.lifespan import Lifespan
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import AppWrapper, ConnectionState, Framework
from hypercorn.utils import wrap_app
from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)

_Listener = trio.SocketListener | trio.SSLListener[trio.SocketStream]
_Stream = trio.SocketStream | trio.SSLStream[trio.SocketStream]

# accept() errors that mean "too many open files / no memory": wait and retry instead of giving up the port
_ACCEPT_CAPACITY_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}


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


class ControlServer:
    """Serves one ASGI app on listeners it owns; see the module docstring for what is contained and how."""

    def __init__(self, app_factory: Callable[[], Framework], metrics: ControlServerMetrics, *,
                 ssl_context: ssl.SSLContext | None = None,
                 backoff: tuple[float, float] = (0.1, 5.0), healthy_after: float = 30.0):
        """``app_factory()`` makes the ASGI app: each life of the server gets a fresh one, so a restart never
        inherits the state a failure left behind."""
        self.config = hypercorn_config()
        self.app_factory = app_factory
        self.metrics = metrics
        self.ssl_context = ssl_context
        self.backoff = backoff
        self.healthy_after = healthy_after  # a run this long resets the back-off

    async def serve(self, host: str, port: int, *, shutdown: trio.Event,
                    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        """Bind ``host:port`` and serve until ``shutdown`` is set (or cancelled);
        ``task_status.started((host, bound_port))``."""
        sockets = await trio.open_tcp_listeners(port, host=host)
        listeners: list[_Listener] = [
            trio.SSLListener(s, self.ssl_context, https_compatible=True) if self.ssl_context else s for s in sockets]
        try:
            task_status.started((host, sockets[0].socket.getsockname()[1]))
            delay = self.backoff[0]
            while not shutdown.is_set():
                started = trio.current_time()
                try:
                    await self._run_once(listeners, shutdown)
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
            with trio.CancelScope(shield=True):
                for sock in sockets:
                    await sock.aclose()

    async def _run_once(self, listeners: list[_Listener], shutdown: trio.Event) -> None:
        """One life of the server: Hypercorn's lifespan, then accepting until ``shutdown``, then a graceful close
        (the same steps as ``hypercorn.trio.run.worker_serve``, with contained connections)."""
        app = wrap_app(self.app_factory(), self.config.wsgi_max_body_size, None)
        lifespan_state: dict[str, Any] = {}
        lifespan = Lifespan(app, self.config, lifespan_state)
        context = WorkerContext(None)
        async with trio.open_nursery() as lifespan_nursery:
            await lifespan_nursery.start(lifespan.handle_lifespan)
            await lifespan.wait_for_startup()
            async with trio.open_nursery() as connections:
                async def handle(stream: _Stream) -> None:
                    await self._connection(app, stream, context, lifespan_state)

                async with trio.open_nursery() as accepting:
                    for listener in listeners:
                        accepting.start_soon(self._accept, listener, connections, handle)
                    await shutdown.wait()
                    accepting.cancel_scope.cancel()
                await context.terminated.set()
                connections.cancel_scope.deadline = trio.current_time() + self.config.graceful_timeout
            await lifespan.wait_for_shutdown()
            lifespan_nursery.cancel_scope.cancel()

    @staticmethod
    async def _accept(listener: _Listener, connections: trio.Nursery,
                      handle: Callable[[_Stream], Awaitable[None]]) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in _ACCEPT_CAPACITY_ERRNOS:
                    raise
                log.error("control port: accept failed (%s); retrying in 100ms", exc)
                await trio.sleep(0.1)
                continue
            connections.start_soon(handle, stream)

    async def _connection(self, app: AppWrapper, stream: _Stream, context: WorkerContext,
                          lifespan_state: dict[str, Any]) -> None:
        try:
            # TCPServer is annotated with SSL streams only; it serves plain ones alike (hypercorn's own serve does)
            await TCPServer(app, self.config, context, ConnectionState(lifespan_state.copy()),
                            stream)  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - one connection's failure stays with it
            self.metrics.connection_failures.inc()
            log.warning("control port: a connection failed inside the server and was closed (%s)", _describe(exc))
            log.debug("control port: connection failure", exc_info=exc)
        finally:  # Hypercorn's own close awaits before closing, so a cancelled connection would stay open
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)

def _describe(exc: BaseException) -> str:
    """``Type: message`` of the first real error inside (nested) exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"
