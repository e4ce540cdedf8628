"""A thin HTTP/1.1 server on Trio with the httptools parser.

It owes what a framework server gives for free: header and body limits,
timeouts for slow clients (head, body, keep-alive idle, writes), chunked
request bodies, ``Expect: 100-continue``, keep-alive, in-order handling of
pipelined requests, and cancellation of the handler when the client goes
away. Errors it produces itself use OpenAI's JSON error shape.

The hot path is kept lean, because every Trio primitive costs microseconds
on the small VMs this runs on (see ``docs/benchmarks.md``):

* A connection is one task that reads a request and answers it. A request
  that is still in its handler after ``DISCONNECT_WATCH_AFTER`` (a stream, a
  long generation) starts a second task for the rest of the connection's
  life: a *reader* that always waits on the socket, so a client that closes
  cancels the handler (and the upstream request) at once, and pipelined
  bytes are parsed and queued in order. No task, nursery or cancel scope is
  created per request; requests are handed over with a bare ``reschedule``.
* Sockets are plain non-blocking sockets driven with
  ``trio.lowlevel.wait_readable``/``wait_writable``; a write that the kernel
  takes whole (the usual case) costs one ``send`` and no scheduling.
* Timeouts are :mod:`llmgw.http.deadlines` watches, armed only while a task
  is parked on the socket, not cancel scopes.
* A response head and a small body go out in one ``send``; a response's
  ``after_send`` (the data plane's accounting) runs after it, off the
  request's path, and a next request already in the socket is read at once.

With an ``ssl.SSLContext`` the server speaks HTTPS only: each accepted socket
becomes a :class:`~llmgw.http.tls_socket.TlsSocket` (the same non-blocking
socket interface, so everything above holds), after a handshake bounded by
``header_timeout``. A client whose handshake fails or stalls loses its own
connection and nothing else; ``on_tls_failure`` counts it.
"""

from __future__ import annotations

import functools
import logging
import math
import socket
import ssl
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import httptools
import trio

from ..lograte import RepeatLimitedLog
from ..tls import describe_tls_error
from .connslots import ConnectionMetrics, ConnectionSlots, accept_connections
from .deadlines import Alarm, Watch
from .listeners import bind_tcp, close_sockets
from .messages import Handler, Request, Response, error_response
from .tls_socket import Stream, TlsSocket, waiting_poller

log = logging.getLogger(__name__)
repeats = RepeatLimitedLog(log)

READ_SIZE = 65536
SMALL_BODY = 16384  # bodies up to this are copied behind the head; larger ones are sent with sendmsg
MAX_QUEUED_REQUESTS = 8  # complete pipelined requests read ahead of the one being answered
LINGER_SECONDS = 2.0  # after an error answer, read and drop the client's bytes for this long at most...
LINGER_BYTES = 1 << 20  # ...and this many bytes at most
# A request still in its handler after this long gets a task that watches its client (see _Connection).
DISCONNECT_WATCH_AFTER = 0.02
QUICK_BEFORE_INLINE = 16  # quick requests in a row after which a connection stops its reader task (see _Connection)
READY_READS = 8  # requests read at once, without waiting, before a connection gives the other tasks a turn
STATUS_LINES = {
    code: f"HTTP/1.1 {code} {reason}\r\n".encode("latin-1")
    for code, reason in [
        (100, "Continue"), (200, "OK"), (201, "Created"), (202, "Accepted"), (204, "No Content"),
        (301, "Moved Permanently"), (302, "Found"), (304, "Not Modified"), (400, "Bad Request"),
        (401, "Unauthorized"), (403, "Forbidden"), (404, "Not Found"), (405, "Method Not Allowed"),
        (408, "Request Timeout"), (409, "Conflict"), (413, "Payload Too Large"),
        (415, "Unsupported Media Type"), (422, "Unprocessable Entity"), (429, "Too Many Requests"),
        (431, "Request Header Fields Too Large"), (499, "Client Closed Request"),
        (500, "Internal Server Error"), (501, "Not Implemented"), (502, "Bad Gateway"),
        (503, "Service Unavailable"), (504, "Gateway Timeout"), (505, "HTTP Version Not Supported"),
        (508, "Loop Detected"),
    ]
}
_NO_BODY_STATUS = {204, 304}
_VERSIONS = ("1.1", "1.0")  # HTTP/0.9 (a bare request line) and anything newer are answered 505
_UNSUPPORTED_VERSION = "Invalid HTTP version"  # llhttp's message for a version it does not speak (HTTP/1.2, 9.9)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_INF = math.inf


def status_line(status: int) -> bytes:
    line = STATUS_LINES.get(status)
    return line if line is not None else f"HTTP/1.1 {status} Status\r\n".encode("latin-1")


@dataclass(frozen=True)
class ServerLimits:
    """Bounds that protect the server from slow or oversized clients."""

    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 16 * 1024 * 1024
    header_timeout: float = 10.0  # from the first byte of a request (from accept, for the first) to its head's end
    body_timeout: float = 30.0  # from the end of the head to the end of the body
    keepalive_timeout: float = 75.0  # idle time allowed between requests on one connection
    write_timeout: float = 60.0  # one write to a client that does not read
    max_connections: int = 10000  # open client connections; one more is answered 503 and closed


class _ProtocolError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class _Message:
    __slots__ = ("method", "url", "headers", "body", "keep_alive", "expect_continue", "continue_sent", "version",
                 "body_size", "started", "head_done_at")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.body_size = 0
        self.method = "GET"
        self.keep_alive = True
        self.expect_continue = False
        self.continue_sent = False
        self.version = "1.1"
        self.started = _INF  # Trio time of the first byte, stamped only when the request spans reads
        self.head_done_at = _INF


class _RequestReader:
    """httptools callbacks that turn a byte stream into complete requests, queued in order."""

    def __init__(self, limits: ServerLimits):
        self.limits = limits
        self.parser = httptools.HttpRequestParser(self)
        self.current: _Message | None = None
        self.complete: deque[_Message] = deque()
        self.head_bytes = 0  # of the current head, counted in the callbacks
        self.unparsed_head_bytes = 0  # bytes of reads that ended inside a head (httptools holds them)
        self.in_head = False
        self.error: _ProtocolError | None = None

    def feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            raise self.error or _ProtocolError(400, "malformed HTTP request") from None
        except httptools.HttpParserUpgrade:
            raise _ProtocolError(501, "protocol upgrades are not supported") from None
        except httptools.HttpParserError as exc:
            if str(exc) == _UNSUPPORTED_VERSION:  # a well-formed HTTP/x.y that llhttp does not speak (HTTP/9.9)
                raise _ProtocolError(505, "this HTTP version is not supported: send HTTP/1.1 (or HTTP/1.0)") from None
            raise _ProtocolError(400, f"malformed HTTP request: {exc}") from None
        if self.in_head or self.current is None:
            # A head still open after this read: bound what the parser may be holding for it.
            self.unparsed_head_bytes += len(data)
            if self.unparsed_head_bytes > self.limits.max_header_bytes:
                raise _ProtocolError(431, "request headers are too large")

    def _too_large(self) -> None:
        self._refuse(431, "request headers are too large")

    def _refuse(self, status: int, message: str) -> None:
        """Stop parsing: the connection answers ``status`` and closes."""
        self.error = _ProtocolError(status, message)
        raise self.error

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.current = _Message()
        self.in_head = True
        self.head_bytes = 0

    # httptools calls on_message_begin first: the callbacks below always have a current message
    def on_url(self, url: bytes) -> None:
        assert self.current is not None
        self.current.url += url
        self.head_bytes += len(url)
        if self.head_bytes > self.limits.max_header_bytes:
            self._too_large()

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.current is not None
        self.current.headers.append((name.lower(), value))
        self.head_bytes += len(name) + len(value) + 4
        if self.head_bytes > self.limits.max_header_bytes:
            self._too_large()

    def on_headers_complete(self) -> None:
        msg = self.current
        assert msg is not None
        self.in_head = False
        self.unparsed_head_bytes = 0
        parser = self.parser
        msg.method = parser.get_method().decode("ascii")
        msg.keep_alive = parser.should_keep_alive()
        msg.version = parser.get_http_version()
        if msg.version not in _VERSIONS:
            self._refuse(505, f"HTTP/{msg.version} is not supported: send HTTP/1.1 (or HTTP/1.0)")
        hosts = 0
        for name, value in msg.headers:
            if name == b"host":
                hosts += 1
            elif name == b"transfer-encoding":
                for coding in value.split(b","):
                    if coding.strip().lower() != b"chunked":
                        self._refuse(501, f"the transfer coding {coding.strip().decode('latin-1')!r} is not "
                                          "supported (only chunked)")
            elif name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.limits.max_body_bytes:
                    self._refuse(413, "request body is larger than the limit of "
                                      f"{self.limits.max_body_bytes} bytes")
            elif name == b"expect" and value.lower() == b"100-continue":
                msg.expect_continue = True
        if msg.version == "1.1" and hosts != 1:
            self._refuse(400, f"an HTTP/1.1 request needs exactly one Host header, not {hosts}")
        if hosts > 1:
            self._refuse(400, f"an HTTP/1.0 request may carry one Host header at most, not {hosts}")

    def on_body(self, body: bytes) -> None:
        msg = self.current
        assert msg is not None
        msg.body_size += len(body)
        if msg.body_size > self.limits.max_body_bytes:
            limit = self.limits.max_body_bytes
            self.error = _ProtocolError(413, f"request body is larger than the limit of {limit} bytes")
            raise self.error
        msg.body.append(body)

    def on_message_complete(self) -> None:
        assert self.current is not None
        self.complete.append(self.current)
        self.current = None


class HttpServer:
    """Serves one handler on one or more listeners; :meth:`drain` stops it gracefully."""

    def __init__(self, handler: Handler, limits: ServerLimits | None = None,
                 on_error: Callable[[BaseException], None] | None = None,
                 error_headers: Callable[[Request | None], list[tuple[bytes, bytes]]] | None = None,
                 on_refused: Callable[[int, list[tuple[bytes, bytes]]], None] | None = None,
                 tls: ssl.SSLContext | None = None,
                 on_tls_failure: Callable[[], None] | None = None,
                 connection_metrics: ConnectionMetrics | None = None, port: str = "data"):
        """``error_headers(request or None)``: headers for the answers the server makes itself (a request it
        refused or could not read, a handler that raised), e.g. the data plane's ``x-request-id``.
        ``on_refused(status, headers)`` is called for every request the server itself answers with an error
        (malformed, too large, too slow, unsupported), with the answer's headers: the handler never saw it.
        ``connection_metrics``: where the ``port``'s open, refused and timed-out connections are counted."""
        self.handler = handler
        self.error_headers = error_headers
        self.tls = tls
        self.tls_failures = 0
        self._on_tls_failure = on_tls_failure
        self.limits = limits or ServerLimits()
        self.active_requests = 0
        # Connections accepted that have not read their first request yet: a drain waits for them too (each for
        # its header timeout at most), or a request on its way when the drain began would be cut.
        self.unread_connections = 0
        self._draining = False
        self._idle: trio.Event | None = None
        self._accepting: trio.CancelScope | None = None
        self._accepting_ended: trio.Event | None = None
        self._connections_scope: trio.CancelScope | None = None
        self.slots = ConnectionSlots(port, self.limits.max_connections, connection_metrics)
        self._on_error = on_error
        self._on_refused = on_refused

    def error(self, status: int, message: str, request: Request | None = None) -> Response:
        """An error answer made by the server itself."""
        headers = self.error_headers(request) if self.error_headers is not None else None
        return error_response(status, message, headers=headers)

    def refuse(self, status: int, message: str) -> Response:
        """The error answer to a request the server refuses itself, reported to ``on_refused``."""
        response = self.error(status, message)
        if self._on_refused is not None:
            self._on_refused(status, response.headers)
        return response

    async def serve(self, host: str, port: int, *, reuse_port: bool = False,
                    task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host:port`` (port 0 picks a free one) and serve until cancelled or drained.

        ``reuse_port``: bind with ``SO_REUSEPORT``, sharing the address with other processes that do (the workers
        of ``llmgw serve --workers``; the kernel spreads new connections across them).
        ``task_status.started((host, port))`` reports the bound address.
        """
        socks = await bind_tcp(host, port, reuse_port=reuse_port)  # plain sockets: see the module docstring
        bound = socks[0].getsockname()
        self._accepting_ended = accepting_ended = trio.Event()
        try:
            async with trio.open_nursery() as connections:
                self._connections_scope = connections.cancel_scope
                def start(sock: socket.socket, addr: Any) -> None:
                    connections.start_soon(self._connection, sock, addr)

                accept = functools.partial(accept_connections, slots=self.slots, start=start,
                                           answer_refused=self.tls is None)
                with trio.CancelScope() as accepting:
                    self._accepting = accepting
                    task_status.started((bound[0], bound[1]))
                    async with trio.open_nursery() as acceptors:
                        for sock in socks:
                            acceptors.start_soon(accept, sock)
                if self._draining:
                    # Connections the kernel completed before the drain are served: closing the listening socket
                    # would reset them, requests already sent included.
                    for sock in socks:
                        await accept(sock, until_empty=True)
                close_sockets(socks)
                accepting_ended.set()
                # Draining: the accept loops are gone; connections finish their current request.
        finally:
            close_sockets(socks)
            accepting_ended.set()

    async def drain(self, grace: float) -> None:
        """Stop accepting, let in-flight requests finish for up to ``grace`` seconds, then cut the rest."""
        self._draining = True
        if self._accepting is not None:
            self._accepting.cancel()
        with trio.move_on_after(grace):
            if self._accepting_ended is not None:
                await self._accepting_ended.wait()
            while self.active_requests or self.unread_connections:
                self._idle = trio.Event()
                await self._idle.wait()
        if self._connections_scope is not None:
            self._connections_scope.cancel()

    @property
    def connections(self) -> int:
        """Client connections open now."""
        return self.slots.open

    async def _connection(self, sock: socket.socket, addr: Any) -> None:
        accepted_at = trio.current_time()
        conn = None
        self.unread_connections += 1
        try:
            stream = sock if self.tls is None else await self._handshake(sock, addr, self.tls)
            if stream is None:
                return
            conn = _Connection(self, stream, addr, accepted_at)
            await conn.run()
        except Exception as exc:  # one bad connection must never take down the server
            if not is_disconnect(exc):
                repeats.error("%s port: an HTTP connection failed: %s: %s", self.slots.port, type(exc).__name__, exc,
                              exc_info=exc)
                if self._on_error:
                    self._on_error(exc)
        finally:
            if conn is None or conn.accepted_at is not None:
                self._first_request_read()  # never read one: no longer waited for
            self.slots.release()
            if conn is not None:
                conn.close()
            elif sock.fileno() >= 0:
                trio.lowlevel.notify_closing(sock)
                sock.close()

    async def _handshake(self, sock: socket.socket, addr: Any, tls: ssl.SSLContext) -> TlsSocket | None:
        """The TLS handshake of a new client within ``header_timeout``; None (counted) when it failed."""
        tls_sock = TlsSocket(sock, tls, server_side=True)
        with trio.move_on_after(self.limits.header_timeout) as deadline:
            try:
                await tls_sock.handshake()
                return tls_sock
            except (ssl.SSLError, OSError) as exc:
                reason = describe_tls_error(exc)
        if deadline.cancelled_caught:
            reason = f"no handshake within {self.limits.header_timeout:g}s"
        self.tls_failures += 1
        if self._on_tls_failure is not None:
            self._on_tls_failure()
        log.debug("TLS handshake with %s failed: %s", addr, reason)
        return None

    def _request_started(self) -> None:
        self.active_requests += 1

    def _request_finished(self) -> None:
        self.active_requests -= 1
        self._maybe_idle()

    def _first_request_read(self) -> None:
        """A connection read its first request (it counts in ``active_requests`` from now on), or ended without."""
        self.unread_connections -= 1
        self._maybe_idle()

    def _maybe_idle(self) -> None:
        if self.active_requests == 0 and self.unread_connections == 0 and self._idle is not None:
            self._idle.set()


class AbortConnection(Exception):
    """Raised by a streaming body to cut the connection: the client must not take a truncated body as whole."""


_DISCONNECTS = (AbortConnection, trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError, trio.TooSlowError)


def is_disconnect(exc: BaseException) -> bool:
    """True when ``exc`` (or every exception in a group) only says that a peer went away or was too slow."""
    if isinstance(exc, BaseExceptionGroup):
        return all(is_disconnect(e) for e in exc.exceptions)
    return isinstance(exc, _DISCONNECTS)


async def serve_http(handler: Handler, host: str, port: int, *, limits: ServerLimits | None = None,
                     task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``handler`` on ``host:port`` until cancelled; reports ``(host, bound_port)`` when listening."""
    await HttpServer(handler, limits).serve(host, port, task_status=task_status)


class _Eof:
    """Set as the connection's end when the client closed an idle connection (or a deadline passed)."""


_EOF = _Eof()



def _after_send(response: Response) -> None:
    """The response's ``after_send``, once; a failure of it is logged (the answer has gone, or could not go)."""
    after = response.after_send
    if after is not None:
        response.after_send = None
        try:
            after()
        except Exception:
            log.exception("the work after sending a %d answer failed", response.status)


async def _close_body(body: object) -> None:
    """A streamed body the server stops iterating before its end (or never iterates) is told so, shielded."""
    aclose = getattr(body, "aclose", None)
    if aclose is not None:
        with trio.CancelScope(shield=True):
            await aclose()

class _Connection:
    """One client connection.

    The connection's own task is the *responder*: it answers requests in order. While it
    is idle it also reads the socket itself ("inline" mode: no second task, no hand-over).
    Once one request has been in the handler for ``DISCONNECT_WATCH_AFTER``, an alarm
    starts a *reader* task that waits on the socket from then on, so that a client going
    away cancels the handler (and the upstream request) at once, and pipelined bytes are
    parsed and queued; the responder then only takes requests off the queue. Quick
    requests never pay for the second task; long ones (streams) are watched. After
    ``QUICK_BEFORE_INLINE`` quick requests in a row (none in its handler as long as
    ``DISCONNECT_WATCH_AFTER``) the reader is stopped and the responder reads inline
    again: handing each request from one task to the other costs a pass through the
    scheduler, which a client that once had one slow request would otherwise pay on
    every request for the rest of the connection.
    """

    def __init__(self, server: HttpServer, sock: Stream, addr: Any, accepted_at: float):
        self.server = server
        self.accepted_at: float | None = accepted_at  # until the first request is read: its head counts from here
        self.limits = server.limits
        self.sock = sock
        self.reader = _RequestReader(server.limits)
        self.client = (addr[0], addr[1]) if isinstance(addr, tuple) and len(addr) >= 2 else None
        self.read_watch = Watch(sock, "keepalive")
        self.write_watch = Watch(sock, "write")
        self.watch_alarm = Alarm(self._start_reader, "disconnect-watch")
        self.client_gone = False
        self.nursery: trio.Nursery | None = None
        # After the queued requests: a protocol error to answer, or _EOF.
        self.final: _ProtocolError | _Eof | None = None
        self.busy = False  # the responder is answering a request (the read deadlines are off)
        self.reader_running = False
        self._reader_scope: trio.CancelScope | None = None  # the running reader's, to stop it
        self._quick_in_a_row = 0  # requests answered within DISCONNECT_WATCH_AFTER while the reader ran
        self._answering: Response | None = None  # the response being sent, until its after_send ran
        self._responder_parked: trio.lowlevel.Task | None = None
        self._reader_parked: trio.lowlevel.Task | None = None
        self.poller = waiting_poller(sock)  # is the client's next request there already? (see _read_inline)
        self._ready_reads = 0

    def close(self) -> None:
        self.read_watch.disarm()
        self.write_watch.disarm()
        self.watch_alarm.disarm()
        sock = self.sock
        if sock.fileno() >= 0:
            trio.lowlevel.notify_closing(sock)
            sock.close()

    async def run(self) -> None:
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                try:
                    await self._respond_loop()
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            self.nursery = None
            self.watch_alarm.disarm()
        watch = self.read_watch
        if watch.expired:
            self.server.slots.timed_out(watch.kind)
        if watch.expired and watch.kind in ("header", "body") and self.reader.current is not None:
            self._try_send(self.server.refuse(408, "request was not received in time"))

    # -- reading -----------------------------------------------------------------------------------------------------

    def _feed(self, data: bytes) -> None:
        """Bytes from the socket (``b""``: the client closed its side)."""
        reader = self.reader
        if not data:
            if self.busy or reader.complete:
                self.client_gone = True  # cancel the handler, and with it the upstream request
                if self.nursery is not None:
                    self.nursery.cancel_scope.cancel()
            elif reader.current is not None:
                self.final = _ProtocolError(400, "client closed the connection in the middle of a request")
            else:
                self.final = _EOF
            return
        try:
            reader.feed(data)
        except _ProtocolError as exc:
            self.final = exc

    async def _read_inline(self) -> None:
        """Idle responder, no reader task: read the socket until something is queued.

        A client's next request is often there already when the answer before it and its accounting are done
        (a client that sends it at once, pipelining or not): it is read without waiting, which saves an
        ``epoll_ctl`` and a pass through the scheduler. ``poll`` asks (a ``recv`` would raise when nothing is
        there, which costs more); every ``READY_READS`` such reads the connection waits anyway, so that one
        busy client lets the other tasks run."""
        sock = self.sock
        reader = self.reader
        if self._ready_reads < READY_READS and self.poller.poll(0):
            self._ready_reads += 1
            data = self._recv_nowait()
            if data is not None:
                self._feed(data)
        else:
            self._ready_reads = 0
        while not reader.complete and self.final is None:
            await self._idle_state_changed()
            try:
                await trio.lowlevel.wait_readable(sock)
            except trio.ClosedResourceError:
                self.final = _EOF  # a deadline passed (``run`` answers 408 where one is due)
                return
            finally:
                self.read_watch.disarm()
            data = self._recv_nowait()
            if data is None:
                continue
            self._feed(data)

    def _recv_nowait(self) -> bytes | None:
        """What the client sent so far: None when nothing is there yet, ``b""`` at its end or on a reset."""
        try:
            return self.sock.recv(READ_SIZE)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _start_reader(self) -> None:
        """The alarm: the handler has been busy for a while, so watch the client from now on."""
        if not self.reader_running and self.nursery is not None and self.final is None:
            self.reader_running = True
            self.nursery.start_soon(self._read_loop)

    async def _read_loop(self) -> None:
        try:
            with trio.CancelScope() as scope:
                self._reader_scope = scope
                await self._read_until_final()
        finally:
            self._reader_scope = None
            self.reader_running = False
            self._wake_responder()  # a responder waiting for this reader reads inline from now on

    def _stop_reader(self) -> None:
        """The responder is idle, nothing is queued or half-read, and the last requests were quick: stop the reader
        (parked in ``wait_readable``; the cancellation unregisters it at once), which wakes the responder when gone."""
        self._quick_in_a_row = 0
        if self._reader_scope is not None:
            self._reader_scope.cancel()

    async def _read_until_final(self) -> None:
        sock = self.sock
        reader = self.reader
        wait_readable = trio.lowlevel.wait_readable
        while self.final is None:
            if len(reader.complete) >= MAX_QUEUED_REQUESTS:
                await self._park_reader()  # TCP backpressure on a client that pipelines too far ahead
                continue
            try:
                await wait_readable(sock)
            except trio.ClosedResourceError:
                # A deadline passed (or the connection is closing): stop the responder if it waits for us.
                self.final = _EOF
                self._wake_responder()
                return
            data = self._recv_nowait()
            if data is None:
                continue
            self._feed(data)
            if reader.complete or self._final_set():
                self._wake_responder()
            elif not self.busy:
                await self._idle_state_changed()

    def _final_set(self) -> bool:
        """Whether ``final`` is set, read afresh: within ``while self.final is None`` mypyc (2.4) takes the
        attribute for None even after a call that set it (``_feed``), and raised TypeError there."""
        return self.final is not None

    async def _park_reader(self) -> None:
        def abort(_: object) -> trio.lowlevel.Abort:
            self._reader_parked = None
            return trio.lowlevel.Abort.SUCCEEDED

        self._reader_parked = trio.lowlevel.current_task()
        await trio.lowlevel.wait_task_rescheduled(abort)

    def _wake_responder(self) -> None:
        task = self._responder_parked
        if task is not None:
            self._responder_parked = None
            trio.lowlevel.reschedule(task)

    async def _wait_for_reader(self) -> None:
        """Idle responder with a reader task: park until it queues something; the read deadline runs."""
        await self._idle_state_changed()
        if self.reader.complete or self.final is not None:
            return

        def abort(_: object) -> trio.lowlevel.Abort:
            self._responder_parked = None
            return trio.lowlevel.Abort.SUCCEEDED

        self._responder_parked = trio.lowlevel.current_task()
        try:
            await trio.lowlevel.wait_task_rescheduled(abort)
        finally:
            self.read_watch.disarm()

    async def _idle_state_changed(self) -> None:
        """The responder is idle: (re)arm the read deadline for the parser's state, answer ``Expect``."""
        current = self.reader.current
        watch = self.read_watch
        limits = self.limits
        if current is None:
            if self.accepted_at is not None:  # a new connection that sent nothing yet: it has the header timeout
                if watch.kind != "header" or watch.when == _INF:
                    watch.arm_at(self.accepted_at + limits.header_timeout, limits.header_timeout, "header")
            elif watch.kind != "keepalive" or watch.when == _INF:
                watch.arm(limits.keepalive_timeout, "keepalive")
            return
        now = trio.current_time()
        if self.reader.in_head:
            if current.started == _INF:
                current.started = now if self.accepted_at is None else self.accepted_at
            if watch.kind != "header" or watch.when == _INF:
                watch.arm_at(current.started + limits.header_timeout, limits.header_timeout, "header")
            return
        if current.head_done_at == _INF:
            current.head_done_at = now
        if watch.kind != "body" or watch.when == _INF:
            watch.arm_at(current.head_done_at + limits.body_timeout, limits.body_timeout, "body")
        if current.expect_continue and not current.continue_sent:
            current.continue_sent = True
            await self._send(_CONTINUE)

    # -- answering ---------------------------------------------------------------------------------------------------

    async def _respond_loop(self) -> None:
        reader = self.reader
        while True:
            if reader.complete:
                msg = reader.complete.popleft()
                if self.accepted_at is not None:
                    self.accepted_at = None  # the next request's head counts from its own first byte
                    self.server._first_request_read()
                if self._reader_parked is not None:
                    task, self._reader_parked = self._reader_parked, None
                    trio.lowlevel.reschedule(task)
            elif self.final is not None:
                if isinstance(self.final, _ProtocolError):
                    await self._send_simple(self.server.refuse(self.final.status, self.final.message))
                    await self._linger()
                return
            elif self.reader_running:
                if self._quick_in_a_row >= QUICK_BEFORE_INLINE and reader.current is None:
                    self._stop_reader()
                await self._wait_for_reader()
                continue
            else:
                await self._read_inline()
                continue
            if not await self._respond(msg):
                return
            if reader.complete:
                await trio.lowlevel.checkpoint()  # pipelined requests answered back to back: let others run

    async def _linger(self) -> None:
        """After an error answer: stop sending, and read (and drop) what the client is still sending for a
        moment before closing, so that closing with unread bytes does not reset the connection and lose the
        answer (a client uploading a body that is too large must still see its 413)."""
        try:  # (a reader task, if any, has stopped: it stops at the error it queued)
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return
        dropped = 0
        with trio.move_on_after(LINGER_SECONDS):
            while dropped < LINGER_BYTES:
                await trio.lowlevel.wait_readable(self.sock)
                data = self._recv_nowait()
                if data is None:
                    continue
                if not data:
                    return
                dropped += len(data)

    async def _respond(self, msg: _Message) -> bool:
        body = msg.body
        request = Request(
            method=msg.method,
            target=msg.url.decode("latin-1"),
            headers=msg.headers,
            body=body[0] if len(body) == 1 else b"".join(body),
            client=self.client,
            http_version=msg.version,
        )
        server = self.server
        keep_alive = msg.keep_alive and not server._draining
        self.busy = True
        server.active_requests += 1
        began = trio.current_time()
        if not self.reader_running:
            # A coarse tick is enough (it sets the sweeper's resolution): watched within 20-30 ms.
            self.watch_alarm.arm_at(began + DISCONNECT_WATCH_AFTER, 4 * DISCONNECT_WATCH_AFTER)
        try:
            try:
                response = await server.handler(request)
            except Exception:
                log.exception("handler failed for %s %s", request.method, request.path)
                response = server.error(500, "internal error in the gateway", request)
            self._answering = response
            keep_alive = await self._send_response(request, response, keep_alive)
        finally:
            # (a plain method with no locals of the await's: mypyc 2.4 miscompiled this finally block inline, a
            # TypeError when the handler was cancelled)
            self._request_done(began)
        return keep_alive and not server._draining

    def _request_done(self, began: float) -> None:
        answering = self._answering
        if answering is not None:
            self._answering = None
            _after_send(answering)  # a no-op once the send called it; else a stream's end or a failed send
        self.watch_alarm.disarm()
        self.busy = False
        self.server._request_finished()
        if self.reader_running:  # (started by this request, it was not quick)
            quick = trio.current_time() - began < DISCONNECT_WATCH_AFTER
            self._quick_in_a_row = self._quick_in_a_row + 1 if quick else 0

    # -- writing -----------------------------------------------------------------------------------------------------

    async def _send_response(self, request: Request, response: Response, keep_alive: bool) -> bool:
        keep_alive = keep_alive and not self.server._draining  # a drain may have begun while the handler ran
        status = response.status
        body = response.body
        head = [status_line(status)]
        has_length = False
        for name, value in response.headers:
            if name == b"content-length":
                has_length = True
            head += (name, b": ", value, b"\r\n")
        head_only = request.method == "HEAD" or status in _NO_BODY_STATUS
        if isinstance(body, (bytes, bytearray, memoryview)):
            if not has_length and status not in _NO_BODY_STATUS:
                head.append(b"content-length: %d\r\n" % len(body))
            if not keep_alive:
                head.append(b"connection: close\r\n")
            head.append(b"\r\n")
            if head_only or not body:
                await self._send(b"".join(head), response)
            elif len(body) <= SMALL_BODY:
                head.append(body)
                await self._send(b"".join(head), response)  # one copy is cheaper than a second system call
            else:
                await self._send_parts(b"".join(head), body, response)
            return keep_alive
        chunked = not has_length and request.http_version == "1.1"
        if chunked:
            head.append(b"transfer-encoding: chunked\r\n")
        elif not has_length:
            keep_alive = False  # HTTP/1.0 without a length: the end of the body is the end of the connection
        if not keep_alive:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        pending = b"".join(head)
        if head_only:
            try:
                await self._send(pending)
            finally:
                await _close_body(body)
            return keep_alive
        try:
            async for piece in body:
                if not piece:  # an empty piece sends the head now (a stream whose first data comes later)
                    if pending:
                        await self._send(pending)
                        pending = b""
                    continue
                if chunked:
                    piece = b"%x\r\n%b\r\n" % (len(piece), piece)
                if pending:
                    piece, pending = pending + piece, b""
                await self._send(piece)
            await self._send(pending + (b"0\r\n\r\n" if chunked else b""))
        except BaseException:
            await _close_body(body)
            raise
        # A body iterated to its end has ended itself: no shielded aclose (a cancel scope per stream) for it.
        return keep_alive

    async def _send_simple(self, response: Response) -> None:
        await self._send_response(Request("GET", "/", []), response, False)

    def _try_send(self, response: Response) -> None:
        """Best effort, never waits: for a 408 on a connection whose deadline already passed."""
        head = [status_line(response.status)]
        for name, value in response.headers:
            head += (name, b": ", value, b"\r\n")
        body = response.body
        assert isinstance(body, bytes)  # the server's own answers are whole
        head.append(b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body))
        head.append(body)
        try:
            self.sock.send(b"".join(head))
        except OSError:
            pass

    async def _send(self, data: bytes, handed: Response | None = None) -> None:
        """Send all of ``data``; a client that takes none of it for ``write_timeout`` is cut off. ``handed``: the
        response whose ``after_send`` runs once the kernel took what it takes at once, before any waiting."""
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise trio.BrokenResourceError(f"client connection broke: {exc}") from None
        if handed is not None:
            _after_send(handed)
        if sent < len(data):
            await self._send_slow(memoryview(data)[sent:])

    async def _send_parts(self, head: bytes, body: bytes | bytearray | memoryview, handed: Response) -> None:
        """Head and body in one ``sendmsg``, without copying the body (``handed``: as in :meth:`_send`)."""
        try:
            sent = self.sock.sendmsg((head, body))
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise trio.BrokenResourceError(f"client connection broke: {exc}") from None
        _after_send(handed)
        if sent < len(head):
            await self._send_slow(memoryview(head)[sent:])
            sent = len(head)
        sent -= len(head)
        if sent < len(body):
            await self._send_slow(memoryview(body)[sent:])

    async def _send_slow(self, view: memoryview) -> None:
        sock = self.sock
        watch = self.write_watch
        try:
            while view:
                watch.arm(self.limits.write_timeout)
                try:
                    await trio.lowlevel.wait_writable(sock)
                except trio.ClosedResourceError:
                    if watch.expired:
                        raise trio.TooSlowError("the client did not read its response in time") from None
                    raise
                watch.disarm()
                try:
                    sent = sock.send(view)
                except BlockingIOError:
                    continue
                except OSError as exc:
                    raise trio.BrokenResourceError(f"client connection broke: {exc}") from None
                view = view[sent:]
        finally:
            watch.disarm()
