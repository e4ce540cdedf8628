"""A pooled keep-alive HTTP/1.1 client for one upstream, on Trio with the httptools parser.

One :class:`UpstreamPool` per upstream ``host:port``. :meth:`UpstreamPool.request`
returns an :class:`UpstreamResponse` as soon as the response head has arrived;
its body is read with :meth:`UpstreamResponse.receive_piece` (pieces as
they arrive) or :meth:`UpstreamResponse.read`. A connection goes back to the pool
only when its response was read to the end and both sides allow keep-alive;
:meth:`UpstreamResponse.aclose` closes it otherwise, which is how a cancelled
client request cancels the upstream request.

Errors are :class:`UpstreamError` with a ``kind`` (``connect``, ``timeout``,
``protocol``, ``closed``) and ``sent_nothing``: whether the upstream can have
seen none of the request's effects (it never got a response head from us).
"""

from __future__ import annotations

import errno
from collections import deque
import httptools
import trio

READ_SIZE = 65536
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
    __slots__ = ("stream", "idle_since", "uses")

    def __init__(self, stream: trio.SocketStream):
        self.stream = stream
        self.idle_since = 0.0
        self.uses = 0


class UpstreamResponse:
    """A response whose head has arrived; read or close its body exactly once."""

    def __init__(self, pool: "UpstreamPool", conn: _Connection, parser: _ResponseParser, idle_timeout: float,
                 head_only: bool):
        self._pool = pool
        self._conn: _Connection | None = conn
        self._parser = parser
        self._idle_timeout = idle_timeout
        self.status = parser.status
        self.headers = parser.headers
        self.head_only = head_only
        if head_only:
            parser.done = True

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    async def receive_piece(self) -> bytes:
        """The next body piece as it arrives (de-chunked); ``b""`` at the end, after which the connection is
        back in the pool."""
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
        pieces, parser.pieces = parser.pieces, []
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while piece := await self.receive_piece():
            parts.append(piece)
        return b"".join(parts)

    async def _receive_more(self) -> None:
        assert self._conn is not None
        with trio.move_on_after(self._idle_timeout) as scope:
            try:
                data = await self._conn.stream.receive_some(READ_SIZE)
            except (trio.BrokenResourceError, OSError) as exc:
                raise UpstreamError("closed", f"upstream connection broke mid-body: {exc}", before_head=False) from None
        if scope.cancelled_caught:
            raise UpstreamError("timeout", f"upstream sent nothing for {self._idle_timeout:g}s mid-body",
                                before_head=False)
        if not data:
            # Without a length, the end of the connection is the end of the body (HTTP/1.0 style).
            self._parser.keep_alive = False
            try:
                self._parser.parser.feed_data(b"")
            except httptools.HttpParserError:
                pass
            if not self._parser.done:
                raise UpstreamError("closed", "upstream closed the connection mid-body", before_head=False)
            return
        try:
            self._parser.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise UpstreamError("protocol", f"malformed upstream response: {exc}", before_head=False) from None

    async def aclose(self) -> None:
        """Give the connection back when the body was read fully, else close it."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._parser.done and self._parser.keep_alive:
            self._pool._release(conn)
        else:
            await self._pool._discard(conn)


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
        payload = head + body if len(body) < 65536 else None
        for attempt in (0, 1):
            conn = await self._acquire()
            reused = conn.uses > 0
            try:
                return await self._exchange(conn, method, head, body, payload, first_byte_timeout, idle_timeout)
            except UpstreamError as exc:
                await self._discard(conn)
                if reused and exc.kind == "closed" and attempt == 0:
                    continue
                raise
            except BaseException:
                await self._discard(conn)
                raise
        raise AssertionError("unreachable")

    async def _exchange(self, conn: _Connection, method: str, head: bytes, body: bytes, payload: bytes | None,
                        first_byte_timeout: float, idle_timeout: float) -> UpstreamResponse:
        conn.uses += 1
        stream = conn.stream
        try:
            if payload is not None:
                await stream.send_all(payload)
            else:
                await stream.send_all(head)
                await stream.send_all(body)
        except (trio.BrokenResourceError, OSError) as exc:
            raise UpstreamError("closed", f"could not send to upstream: {exc}") from None
        parser = _ResponseParser()
        with trio.move_on_after(first_byte_timeout) as scope:
            while not parser.head_done:
                try:
                    data = await stream.receive_some(READ_SIZE)
                except (trio.BrokenResourceError, OSError) as exc:
                    raise UpstreamError("closed", f"upstream connection broke: {exc}") from None
                if not data:
                    raise UpstreamError("closed", "upstream closed the connection without answering")
                try:
                    parser.parser.feed_data(data)
                except httptools.HttpParserError as exc:
                    raise UpstreamError("protocol", f"malformed upstream response: {exc}") from None
        if scope.cancelled_caught:
            raise UpstreamError("timeout", f"no response head from upstream within {first_byte_timeout:g}s")
        return UpstreamResponse(self, conn, parser, idle_timeout, head_only=method == "HEAD")

    def _encode_head(self, method: str, target: str, headers: list[tuple[bytes, bytes]], length: int) -> bytes:
        lines = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1"), b"host: ", self.host_header, b"\r\n"]
        for name, value in headers:
            if name not in HOP_BY_HOP:
                lines += (name, b": ", value, b"\r\n")
        if length or method in ("POST", "PUT", "PATCH"):
            lines.append(b"content-length: %d\r\n" % length)
        lines.append(b"\r\n")
        return b"".join(lines)

    async def _acquire(self) -> _Connection:
        now = trio.current_time()
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < self.idle_expiry:
                return conn
            await self._discard(conn)
        try:
            with trio.fail_after(self.connect_timeout):
                stream = await trio.open_tcp_stream(self.host, self.port)
        except trio.TooSlowError:
            raise UpstreamError("connect", f"connecting to {self.host}:{self.port} took longer than "
                                           f"{self.connect_timeout:g}s") from None
        except OSError as exc:
            reason = errno.errorcode.get(exc.errno or 0, "") or str(exc)
            raise UpstreamError("connect", f"cannot connect to {self.host}:{self.port}: {reason}") from None
        self.open_connections += 1
        return _Connection(stream)

    def _release(self, conn: _Connection) -> None:
        if len(self._idle) >= self.max_idle:
            self.open_connections -= 1
            conn.stream.socket.close()
            return
        conn.idle_since = trio.current_time()
        self._idle.append(conn)

    async def _discard(self, conn: _Connection) -> None:
        self.open_connections -= 1
        await trio.aclose_forcefully(conn.stream)

    async def aclose(self) -> None:
        while self._idle:
            await self._discard(self._idle.pop())
