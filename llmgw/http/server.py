"""A thin HTTP/1.1 server on Trio with the httptools parser.

It owes what a framework server gives for free: header and body limits,
timeouts for slow clients (head, body, keep-alive idle, writes), chunked
request bodies, ``Expect: 100-continue``, keep-alive, sequential handling of
pipelined requests, and cancellation of the handler when the client goes
away. Errors it produces itself use OpenAI's JSON error shape.

One connection is served by one task: it reads a request, runs the handler
while a watcher task reads the socket (so EOF cancels the handler and any
pipelined bytes are kept for the parser), writes the response, and loops.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass
from typing import Callable

import httptools
import trio

from .messages import Handler, Request, Response, error_response

log = logging.getLogger(__name__)

READ_SIZE = 65536
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
        (503, "Service Unavailable"), (504, "Gateway Timeout"),
    ]
}
_NO_BODY_STATUS = {204, 304}


def status_line(status: int) -> bytes:
    line = STATUS_LINES.get(status)
    return line if line is not None else f"HTTP/1.1 {status} Status\r\n".encode("latin-1")


@dataclass(frozen=True)
class ServerLimits:
    """Bounds that protect the server from slow or oversized clients."""

    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 16 * 1024 * 1024
    header_timeout: float = 10.0  # from the first byte of a request to the end of its head
    body_timeout: float = 30.0  # from the end of the head to the end of the body
    keepalive_timeout: float = 75.0  # idle time allowed between requests on one connection
    write_timeout: float = 60.0  # one write to a client that does not read
    max_connections: int = 10000


class _ProtocolError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


class _Message:
    __slots__ = ("method", "url", "headers", "body", "keep_alive", "expect_continue", "version", "body_size")

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.body_size = 0
        self.method = "GET"
        self.keep_alive = True
        self.expect_continue = False
        self.version = "1.1"


class _RequestReader:
    """httptools callbacks that turn a byte stream into complete requests, queued in order."""

    def __init__(self, limits: ServerLimits):
        self.limits = limits
        self.parser = httptools.HttpRequestParser(self)
        self.current: _Message | None = None
        self.complete: deque[_Message] = deque()
        self.head_bytes = 0
        self.in_head = False
        self.error: _ProtocolError | None = None

    def feed(self, data: bytes) -> None:
        if not self.current or self.in_head:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            raise self.error or _ProtocolError(400, "malformed HTTP request") from None
        except httptools.HttpParserUpgrade:
            raise _ProtocolError(501, "protocol upgrades are not supported") from None
        except httptools.HttpParserError as exc:
            raise _ProtocolError(400, f"malformed HTTP request: {exc}") from None
        if self.in_head and self.head_bytes > self.limits.max_header_bytes:
            raise _ProtocolError(431, "request headers are too large")

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.current = _Message()
        self.in_head = True
        self.head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self.current.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        msg = self.current
        self.in_head = False
        msg.method = self.parser.get_method().decode("ascii")
        msg.keep_alive = self.parser.should_keep_alive()
        msg.version = self.parser.get_http_version()
        for name, value in msg.headers:
            if name == b"expect" and value.lower() == b"100-continue":
                msg.expect_continue = True
            elif name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.limits.max_body_bytes:
                    self.error = _ProtocolError(
                        413, f"request body is larger than the limit of {self.limits.max_body_bytes} bytes")
                    raise self.error

    def on_body(self, body: bytes) -> None:
        msg = self.current
        msg.body_size += len(body)
        if msg.body_size > self.limits.max_body_bytes:
            self.error = _ProtocolError(413, f"request body is larger than the limit of {self.limits.max_body_bytes} bytes")
            raise self.error
        msg.body.append(body)

    def on_message_complete(self) -> None:
        self.complete.append(self.current)
        self.current = None


class HttpServer:
    """Serves one handler on one or more listeners; :meth:`drain` stops it gracefully."""

    def __init__(self, handler: Handler, limits: ServerLimits | None = None,
                 on_error: Callable[[BaseException], None] | None = None):
        self.handler = handler
        self.limits = limits or ServerLimits()
        self.active_requests = 0
        self.connections = 0
        self._draining = False
        self._idle = trio.Event()
        self._idle.set()
        self._accepting: trio.CancelScope | None = None
        self._connections_scope: trio.CancelScope | None = None
        self._conn_slots = trio.Semaphore(self.limits.max_connections)
        self._on_error = on_error

    async def serve(self, host: str, port: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``host:port`` (port 0 picks a free one) and serve until cancelled or drained.

        ``task_status.started((host, port))`` reports the bound address.
        """
        listeners = await trio.open_tcp_listeners(port, host=host)
        bound = listeners[0].socket.getsockname()
        async with trio.open_nursery() as connections:
            self._connections_scope = connections.cancel_scope
            with trio.CancelScope() as accepting:
                self._accepting = accepting
                task_status.started((bound[0], bound[1]))
                async with trio.open_nursery() as acceptors:
                    for listener in listeners:
                        acceptors.start_soon(self._accept_loop, listener, connections)
            for listener in listeners:
                await listener.aclose()
            # Draining: the accept loops are gone; connections finish their current request.

    async def drain(self, grace: float) -> None:
        """Stop accepting, let in-flight requests finish for up to ``grace`` seconds, then cut the rest."""
        self._draining = True
        if self._accepting is not None:
            self._accepting.cancel()
        with trio.move_on_after(grace):
            while self.active_requests:
                await self._idle.wait()
        if self._connections_scope is not None:
            self._connections_scope.cancel()

    async def _accept_loop(self, listener: trio.SocketListener, connections: trio.Nursery) -> None:
        while True:
            await self._conn_slots.acquire()
            try:
                stream = await listener.accept()
            except BaseException:
                self._conn_slots.release()
                raise
            connections.start_soon(self._connection, stream)

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        try:
            await _Connection(self, stream).run()
        except Exception as exc:  # one bad connection must never take down the server
            if not is_disconnect(exc):
                log.exception("HTTP connection failed")
                if self._on_error:
                    self._on_error(exc)
        finally:
            self.connections -= 1
            self._conn_slots.release()
            await trio.aclose_forcefully(stream)

    def _request_started(self) -> None:
        if self.active_requests == 0:
            self._idle = trio.Event()
        self.active_requests += 1

    def _request_finished(self) -> None:
        self.active_requests -= 1
        if self.active_requests == 0:
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
                     task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Serve ``handler`` on ``host:port`` until cancelled; reports ``(host, bound_port)`` when listening."""
    await HttpServer(handler, limits).serve(host, port, task_status=task_status)


class _Connection:
    def __init__(self, server: HttpServer, stream: trio.SocketStream):
        self.server = server
        self.limits = server.limits
        self.stream = stream
        self.reader = _RequestReader(server.limits)
        self.client_gone = False
        self.pending_error: _ProtocolError | None = None
        try:
            peer = stream.socket.getpeername()
            self.client = (peer[0], peer[1])
        except OSError:
            self.client = None

    async def run(self) -> None:
        first = True
        while not self.server._draining or first:
            first = False
            try:
                msg = await self._read_request()
            except _ProtocolError as exc:
                await self._send_simple(error_response(exc.status, exc.message), keep_alive=False)
                return
            except trio.TooSlowError:
                if self.reader.current is not None:
                    await self._send_simple(error_response(408, "request was not received in time"), keep_alive=False)
                return
            if msg is None:
                return
            keep_alive = await self._respond(msg)
            if not keep_alive or self.client_gone:
                return

    async def _read_request(self) -> _Message | None:
        """The next complete request, or None when the client closed an idle connection."""
        reader = self.reader
        if self.pending_error is not None:
            raise self.pending_error
        if reader.complete:
            return reader.complete.popleft()
        deadline = trio.current_time() + self.limits.keepalive_timeout
        head_deadline = body_deadline = math.inf
        continue_sent = False
        while not reader.complete:
            current = reader.current
            if current is not None:
                if reader.in_head:
                    if head_deadline == math.inf:
                        head_deadline = trio.current_time() + self.limits.header_timeout
                    deadline = head_deadline
                else:
                    if body_deadline == math.inf:
                        body_deadline = trio.current_time() + self.limits.body_timeout
                    deadline = body_deadline
                    if current.expect_continue and not continue_sent:
                        continue_sent = True
                        await self._send_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            with trio.CancelScope(deadline=deadline) as scope:
                data = await self.stream.receive_some(READ_SIZE)
            if scope.cancelled_caught:
                raise trio.TooSlowError
            if not data:
                if reader.current is not None:
                    raise _ProtocolError(400, "client closed the connection in the middle of a request")
                return None
            reader.feed(data)
        return reader.complete.popleft()

    async def _respond(self, msg: _Message) -> bool:
        request = Request(
            method=msg.method,
            target=msg.url.decode("latin-1"),
            headers=msg.headers,
            body=b"".join(msg.body) if len(msg.body) != 1 else msg.body[0],
            client=self.client,
            http_version=msg.version,
        )
        keep_alive = msg.keep_alive and not self.server._draining
        self.server._request_started()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watch_client, nursery.cancel_scope)
                try:
                    response = await self.server.handler(request)
                except Exception:
                    log.exception("handler failed for %s %s", request.method, request.path)
                    response = error_response(500, "internal error in the gateway")
                keep_alive = await self._send_response(request, response, keep_alive)
                nursery.cancel_scope.cancel()
        finally:
            self.server._request_finished()
        return keep_alive and not self.server._draining

    async def _watch_client(self, scope: trio.CancelScope) -> None:
        """Cancel ``scope`` when the client closes; keep pipelined bytes for the parser."""
        buffered = 0
        while buffered < self.limits.max_header_bytes:
            data = await self.stream.receive_some(READ_SIZE)
            if not data:
                self.client_gone = True
                scope.cancel()
                return
            buffered += len(data)
            try:
                self.reader.feed(data)
            except _ProtocolError as exc:
                self.pending_error = exc
                break
        # A client that pipelines this much is not read until we answer: TCP backpressure.
        await trio.sleep_forever()

    async def _send_response(self, request: Request, response: Response, keep_alive: bool) -> bool:
        status = response.status
        body = response.body
        head = [status_line(status)]
        has_length = False
        for name, value in response.headers:
            if name == b"content-length":
                has_length = True
            head.append(name + b": " + value + b"\r\n")
        head_only = request.method == "HEAD" or status in _NO_BODY_STATUS
        if isinstance(body, (bytes, bytearray, memoryview)):
            if not has_length and status not in _NO_BODY_STATUS:
                head.append(b"content-length: %d\r\n" % len(body))
            if not keep_alive:
                head.append(b"connection: close\r\n")
            head.append(b"\r\n")
            await self._send_all(b"".join(head) if head_only else b"".join(head) + body)
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
        try:
            if head_only:
                await self._send_all(pending)
                return keep_alive
            async for piece in body:
                if not piece:
                    continue
                if chunked:
                    piece = b"%x\r\n%b\r\n" % (len(piece), piece)
                if pending:
                    piece, pending = pending + piece, b""
                await self._send_all(piece)
            await self._send_all(pending + (b"0\r\n\r\n" if chunked else b""))
        finally:
            aclose = getattr(body, "aclose", None)
            if aclose is not None:
                with trio.CancelScope(shield=True):
                    await aclose()
        return keep_alive

    async def _send_simple(self, response: Response, keep_alive: bool) -> None:
        with trio.move_on_after(self.limits.write_timeout):
            await self._send_response(Request("GET", "/", []), response, keep_alive)

    async def _send_all(self, data: bytes) -> None:
        with trio.CancelScope(deadline=trio.current_time() + self.limits.write_timeout) as scope:
            await self.stream.send_all(data)
        if scope.cancelled_caught:
            raise trio.TooSlowError
