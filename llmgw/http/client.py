"""A pooled keep-alive HTTP/1.1 client for one upstream, on Trio with the httptools parser.

One :class:`UpstreamPool` per upstream ``host:port``. :meth:`UpstreamPool.request`
returns an :class:`UpstreamResponse` as soon as the response head has arrived;
its body is read with :meth:`UpstreamResponse.receive_piece` (pieces as
they arrive) or :meth:`UpstreamResponse.read`. A connection goes back to the pool
only when its response was read to the end and both sides allow keep-alive;
:meth:`UpstreamResponse.aclose` closes it otherwise, which is how a cancelled
client request cancels the upstream request.

Errors are :class:`UpstreamError` with a ``kind`` (``connect``, ``timeout``,
``protocol``, ``closed``) and ``before_head``: whether the upstream can have
seen none of the request's effects (it never got a response head from us).

Like :mod:`llmgw.http.server`, the hot path uses plain non-blocking sockets
with ``trio.lowlevel.wait_readable`` and :mod:`llmgw.http.deadlines` watches
instead of ``trio.SocketStream`` and cancel scopes: a request whose head and
body fit in one ``send`` and whose answer arrives in one read costs one
``send``, one wait and one ``recv``.
"""

from __future__ import annotations

import errno
import socket
import time
from collections import deque

import httptools
import trio

from .deadlines import Watch

READ_SIZE = 65536
INLINE_SEND = 65536  # request bodies below this are sent in the same write as the head
YIELD_EVERY = 8  # pieces read without waiting before a stream gives other tasks a turn
HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
    b"transfer-encoding", b"upgrade", b"content-length", b"host",
})


class UpstreamError(Exception):
    """The upstream could not be reached, was too slow, or broke the protocol."""

    def __init__(self, kind: str, message: str, *, before_head: bool = True):
        super().__init__(message)
        self.kind = kind
        self.before_head = before_head


class _ResponseParser:
    """httptools callbacks collecting one response's head and body pieces."""

    __slots__ = ("parser", "status", "headers", "head_done", "pieces", "done", "keep_alive")

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.reset()

    def reset(self) -> None:
        """Ready for the next response on the same connection (httptools parses them back to back)."""
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.pieces: list[bytes] = []
        self.done = False
        self.keep_alive = True

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.pieces.append(body)

    def on_message_complete(self) -> None:
        self.done = True


class _Connection:
    __slots__ = ("sock", "watch", "idle_since", "uses", "parser")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.watch = Watch(sock, "upstream")
        self.idle_since = 0.0
        self.uses = 0
        self.parser: _ResponseParser | None = None  # kept while responses end cleanly

    def close(self) -> None:
        self.watch.disarm()
        sock = self.sock
        if sock.fileno() >= 0:
            trio.lowlevel.notify_closing(sock)
            sock.close()

    async def _wait(self, wait, timeout: float, timeout_message: str, before_head: bool) -> None:
        """``wait(sock)`` (readable or writable) for at most ``timeout`` seconds, as an UpstreamError otherwise."""
        watch = self.watch
        watch.arm(timeout)
        try:
            await wait(self.sock)
        except trio.ClosedResourceError:
            if watch.expired:
                raise UpstreamError("timeout", timeout_message, before_head=before_head) from None
            raise UpstreamError("closed", "upstream connection was closed", before_head=before_head) from None
        finally:
            watch.disarm()

    async def receive(self, timeout: float, timeout_message: str, before_head: bool) -> bytes:
        """Wait (at most ``timeout`` seconds) for bytes; ``b""`` when the upstream closed."""
        sock = self.sock
        while True:
            await self._wait(trio.lowlevel.wait_readable, timeout, timeout_message, before_head)
            try:
                return sock.recv(READ_SIZE)
            except BlockingIOError:
                continue
            except OSError as exc:
                raise UpstreamError("closed", f"upstream connection broke: {exc}", before_head=before_head) from None

    async def send_all(self, data, timeout: float) -> None:
        sock = self.sock
        try:
            sent = sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise UpstreamError("closed", f"could not send to upstream: {exc}") from None
        if sent == len(data):
            return
        view = memoryview(data)[sent:]
        while view:
            await self._wait(trio.lowlevel.wait_writable, timeout,
                             f"upstream did not take the request within {timeout:g}s", before_head=True)
            try:
                view = view[sock.send(view):]
            except BlockingIOError:
                continue
            except OSError as exc:
                raise UpstreamError("closed", f"could not send to upstream: {exc}") from None


class UpstreamResponse:
    """A response whose head has arrived; read or close its body exactly once."""

    def __init__(self, pool: "UpstreamPool", conn: _Connection, parser: _ResponseParser, idle_timeout: float,
                 head_only: bool):
        self._pool = pool
        self._conn: _Connection | None = conn
        self._parser = parser
        self._idle_timeout = idle_timeout
        self._ready_reads = 0
        self.status = parser.status
        self.headers = parser.headers
        self.head_only = head_only
        if head_only:
            parser.done = True
            parser.pieces = []
            conn.parser = None  # httptools would wait for the body a HEAD answer announces: start afresh

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    @property
    def complete(self) -> bool:
        """The whole body has arrived (it may not all have been taken with :meth:`receive_piece` yet)."""
        return self._parser.done

    @property
    def piece_ready(self) -> bool:
        """:meth:`receive_piece` will answer without waiting (a piece, or the end, came with what was read)."""
        return bool(self._parser.pieces) or self._parser.done

    async def receive_piece(self) -> bytes:
        """The next body piece as it arrives (de-chunked; what arrived in one read comes as one piece);
        ``b""`` at the end, after which the connection is back in the pool."""
        parser = self._parser
        try:
            while not parser.pieces:
                if parser.done:
                    await self.aclose()
                    return b""
                await self._receive_more()
        except BaseException:
            await self.aclose()
            raise
        pieces = parser.pieces
        parser.pieces = []
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def read(self) -> bytes:
        """The whole body."""
        parser = self._parser
        if parser.done:  # it came with the head: the usual case for small answers
            pieces = parser.pieces
            parser.pieces = []
            await self.aclose()
            return pieces[0] if len(pieces) == 1 else b"".join(pieces)
        parts = []
        while piece := await self.receive_piece():
            parts.append(piece)
        return b"".join(parts)

    async def _receive_more(self) -> None:
        conn = self._conn
        if conn is None:
            raise UpstreamError("closed", "the upstream response was already closed", before_head=False)
        if self._ready_reads >= YIELD_EVERY:
            self._ready_reads = 0
            await trio.lowlevel.checkpoint()
        # A stream's next piece is often in the socket already: try before paying for a wait.
        try:
            data = conn.sock.recv(READ_SIZE)
            self._ready_reads += 1
        except BlockingIOError:
            self._ready_reads = 0
            data = await conn.receive(self._idle_timeout, f"upstream sent nothing for {self._idle_timeout:g}s "
                                                          "mid-body", before_head=False)
        except OSError as exc:
            raise UpstreamError("closed", f"upstream connection broke mid-body: {exc}", before_head=False) from None
        if not data:
            # Without a length or chunks, the end of the connection is the end of the body (HTTP/1.0 style).
            parser = self._parser
            parser.keep_alive = False
            if not parser.done and self._ends_with_connection():
                parser.done = True
            if not parser.done:
                raise UpstreamError("closed", "upstream closed the connection mid-body", before_head=False)
            return
        try:
            self._parser.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise UpstreamError("protocol", f"malformed upstream response: {exc}", before_head=False) from None

    def _ends_with_connection(self) -> bool:
        for name, value in self.headers:
            if name == b"content-length" or (name == b"transfer-encoding" and b"chunked" in value.lower()):
                return False
        return True

    async def aclose(self) -> None:
        """Give the connection back when the body was read fully, else close it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._parser.done and self._parser.keep_alive:
            self._pool._release(conn)
        else:
            self._pool._discard_now(conn)


class UpstreamPool:
    """Keep-alive connections to one upstream ``host:port``."""

    def __init__(self, host: str, port: int, *, connect_timeout: float = 3.0, max_idle: int = 128,
                 idle_expiry: float = 4.0):
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        # Upstream servers close idle keep-alive connections (uvicorn after 5 s); reuse only fresher ones.
        self.idle_expiry = idle_expiry
        self._idle: deque[_Connection] = deque()
        self.open_connections = 0
        self.host_header = (host if ":" not in host else f"[{host}]").encode() + b":%d" % port

    async def request(self, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes, *,
                      first_byte_timeout: float, idle_timeout: float) -> UpstreamResponse:
        """Send a request and wait for the response head.

        A pooled connection that turns out to be closed by the upstream before
        any response byte is retried once on a fresh connection.
        """
        head = self._encode_head(method, target, headers, len(body))
        if len(body) < INLINE_SEND:
            head, body = head + body, b""
        for attempt in (0, 1):
            conn = await self._acquire()
            reused = conn.uses > 0
            try:
                return await self._exchange(conn, method, head, body, first_byte_timeout, idle_timeout)
            except UpstreamError as exc:
                self._discard_now(conn)
                if reused and exc.kind == "closed" and attempt == 0:
                    continue
                raise
            except BaseException:
                self._discard_now(conn)
                raise
        raise AssertionError("unreachable")

    async def _exchange(self, conn: _Connection, method: str, head: bytes, body: bytes,
                        first_byte_timeout: float, idle_timeout: float) -> UpstreamResponse:
        conn.uses += 1
        await conn.send_all(head, first_byte_timeout)
        if body:
            await conn.send_all(body, first_byte_timeout)
        parser = conn.parser
        if parser is None:
            parser = conn.parser = _ResponseParser()
        else:
            parser.reset()
        feed = parser.parser.feed_data
        message = f"no response head from upstream within {first_byte_timeout:g}s"
        while not parser.head_done:
            data = await conn.receive(first_byte_timeout, message, before_head=True)
            if not data:
                raise UpstreamError("closed", "upstream closed the connection without answering")
            try:
                feed(data)
            except httptools.HttpParserError as exc:
                raise UpstreamError("protocol", f"malformed upstream response: {exc}") from None
        return UpstreamResponse(self, conn, parser, idle_timeout, head_only=method == "HEAD")

    def _encode_head(self, method: str, target: str, headers: list[tuple[bytes, bytes]], length: int) -> bytes:
        lines = [f"{method} {target} HTTP/1.1\r\nhost: ".encode("latin-1"), self.host_header, b"\r\n"]
        for name, value in headers:
            if name not in HOP_BY_HOP:
                lines += (name, b": ", value, b"\r\n")
        if length or method in ("POST", "PUT", "PATCH"):
            lines.append(b"content-length: %d\r\n\r\n" % length)
        else:
            lines.append(b"\r\n")
        return b"".join(lines)

    async def _acquire(self) -> _Connection:
        idle = self._idle
        if idle:
            now = time.monotonic()
            while idle:
                conn = idle.pop()
                if now - conn.idle_since < self.idle_expiry and conn.sock.fileno() >= 0:
                    return conn
                self._discard_now(conn)
        try:
            with trio.fail_after(self.connect_timeout):
                stream = await trio.open_tcp_stream(self.host, self.port)
        except trio.TooSlowError:
            raise UpstreamError("connect", f"connecting to {self.host}:{self.port} took longer than "
                                           f"{self.connect_timeout:g}s") from None
        except OSError as exc:
            reason = errno.errorcode.get(exc.errno or 0, "") or str(exc)
            raise UpstreamError("connect", f"cannot connect to {self.host}:{self.port}: {reason}") from None
        # From here on a plain non-blocking socket (TCP_NODELAY was set by trio).
        sock = socket.socket(fileno=stream.socket.detach())
        sock.setblocking(False)
        self.open_connections += 1
        return _Connection(sock)

    def _release(self, conn: _Connection) -> None:
        if len(self._idle) >= self.max_idle:
            self._discard_now(conn)
            return
        conn.idle_since = time.monotonic()
        self._idle.append(conn)

    def _discard_now(self, conn: _Connection) -> None:
        self.open_connections -= 1
        conn.close()

    async def _discard(self, conn: _Connection) -> None:
        self._discard_now(conn)

    async def aclose(self) -> None:
        while self._idle:
            self._discard_now(self._idle.pop())
