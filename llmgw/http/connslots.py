"""Accepting client connections on one port within its cap, for the data and the control port alike.

A port holds at most ``cap`` client connections (set from the open-files limit:
:mod:`llmgw.fdlimit`). :func:`accept_connections` accepts from one listening
socket and hands each connection to the port's server; a connection that
arrives at the cap is answered ``503`` at once (one non-blocking ``send``, no
read, no task) and closed, and counted: the client learns to retry, and the
descriptors left stay with the engine connections. ``accept()`` failures for
want of descriptors or memory are retried after 100 ms, counted and logged at
most once per 10 s (:mod:`llmgw.fdpressure`).
"""

from __future__ import annotations

import errno
import logging
import socket
from collections.abc import Callable
from typing import Any

import trio
from prometheus_client import CollectorRegistry, Counter, Gauge

from ..fdpressure import capacity_errno, note_shortage
from ..lograte import RepeatLimitedLog
from .messages import error_body

log = logging.getLogger(__name__)
repeats = RepeatLimitedLog(log)

# accept() errors that concern only the connection being accepted (gone before it was taken)
_GONE_ERRNOS = frozenset({errno.ECONNABORTED, errno.EPROTO, errno.EPERM, errno.EINTR})
CAPACITY_RETRY = 0.1


class ConnectionMetrics:
    """Both ports' connection series, labelled ``port`` (``data``, ``control``)."""

    def __init__(self, registry: CollectorRegistry):
        self.open = Gauge("llmgw_connections_open", "Client connections open, by port.", ["port"], registry=registry)
        self.cap = Gauge("llmgw_connections_limit", "The most client connections a port holds (from the open-files "
                         "limit and the configured bound); one more is answered 503 and closed.", ["port"],
                         registry=registry)
        self.refused = Counter("llmgw_connections_refused", "Client connections answered 503 and closed at once "
                               "because their port was at its connection cap, by port.", ["port"], registry=registry)
        self.timeouts = Counter("llmgw_connection_timeouts", "Client connections closed by a read deadline, by port "
                                "and phase: header (no complete request head in limits.client_header_timeout, counted "
                                "from accept for a connection's first request), body "
                                "(limits.client_body_timeout), keepalive (idle between requests).",
                                ["port", "phase"], registry=registry)


def canned_answer(status: int, reason: str, message: str, *, code: str | None = None, extra: bytes = b"") -> bytes:
    """A whole error answer (OpenAI's shape) that closes the connection, for answers made without a handler;
    ``extra``: more header lines, each ending in CRLF."""
    body = error_body(status, message, code=code)
    return (b"HTTP/1.1 %d %b\r\ncontent-type: application/json\r\n%bconnection: close\r\ncontent-length: %d\r\n\r\n%b"
            % (status, reason.encode(), extra, len(body), body))


class ConnectionSlots:
    """One port's open connections against its cap; counts the refused ones and the timeouts."""

    def __init__(self, port: str, cap: int, metrics: ConnectionMetrics | None = None):
        self.port = port
        self.cap = cap
        self.open = 0
        self.refused = 0
        self._metrics = metrics
        self._busy_answer = canned_answer(503, "Service Unavailable", f"the {port} port is at its limit of {cap} "
                                          "connections; retry shortly", code="too_many_connections",
                                          extra=b"retry-after: 1\r\n")
        if metrics is not None:
            metrics.cap.labels(port).set(cap)

    def take(self) -> bool:
        """Count a new connection in; False (and nothing counted in) at the cap."""
        if self.open >= self.cap:
            return False
        self.open += 1
        if self._metrics is not None:
            self._metrics.open.labels(self.port).inc()
        return True

    def release(self) -> None:
        self.open -= 1
        if self._metrics is not None:
            self._metrics.open.labels(self.port).dec()

    def timed_out(self, phase: str) -> None:
        if self._metrics is not None:
            self._metrics.timeouts.labels(self.port, phase).inc()

    def refuse(self, sock: socket.socket, *, answer: bool) -> None:
        """A connection over the cap: ``answer`` (plain HTTP) sends the 503 without waiting; then it is closed."""
        self.refused += 1
        if self._metrics is not None:
            self._metrics.refused.labels(self.port).inc()
        repeats.warning("%s port: at its cap of %d connections: new connections are answered 503 and closed "
                        "(the cap comes from the open-files limit: docs/security.md#sockets)", self.port, self.cap)
        try:
            if answer:
                sock.setblocking(False)
                sock.send(self._busy_answer)
                sock.shutdown(socket.SHUT_WR)
                try:  # the request already sent, read so that closing does not reset the connection
                    sock.recv(65536)
                except OSError:
                    pass
        except OSError:
            pass
        finally:
            sock.close()


async def accept_connections(lsock: socket.socket, slots: ConnectionSlots,
                             start: Callable[[socket.socket, Any], None], *, answer_refused: bool = True,
                             until_empty: bool = False) -> None:
    """Accept from the non-blocking listening socket ``lsock`` until cancelled (``until_empty``: until no connection
    is waiting, e.g. the ones the kernel completed before a drain): ``start(sock, address)`` for each connection
    within the cap (the server calls ``slots.release()`` when it ends), a quick 503 for the others
    (``answer_refused=False``: close only, e.g. on a TLS port). Errors other than running short and a connection
    gone before it was taken end the loop."""
    while True:
        try:
            sock, address = lsock.accept()
        except BlockingIOError:
            if until_empty:
                return
            await trio.lowlevel.wait_readable(lsock)
            continue
        except OSError as exc:
            if capacity_errno(exc) is not None:  # no descriptor right now: retry rather than give up the port
                note_shortage(f"{slots.port}_accept", exc)
                await trio.sleep(CAPACITY_RETRY)
                continue
            if exc.errno in _GONE_ERRNOS:
                continue
            raise
        if not slots.take():
            slots.refuse(sock, answer=answer_refused)
        else:
            try:
                sock.setblocking(False)
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # the peer is already gone
                sock.close()
                slots.release()
            else:
                start(sock, address)
        await trio.lowlevel.checkpoint()  # a flood of connections must not hold the loop
