"""A pooled keep-alive HTTP/1.1 client for one upstream, on Trio with the httptools parser.

One :class:`UpstreamPool` per upstream ``host:port``. :meth:`UpstreamPool.request`
returns an :class:`UpstreamResponse` as soon as the response head has arrived;
its body is read with :meth:`UpstreamResponse.receive_piece` (pieces as
they arrive) or :meth:`UpstreamResponse.read`. A connection goes back to the pool
only when its response was read to the end and both sides allow keep-alive;
:meth:`UpstreamResponse.aclose` closes it otherwise, which is how a cancelled
client request cancels the upstream request.

Errors are :class:`UpstreamError` with a ``kind`` and ``before_head`` (no
response head had arrived). The kinds say how far the request got, which is
what decides whether the request itself may have caused the failure:

- ``connect``: no connection (refused, unreachable, too slow to connect);
- ``capacity``: no socket could be opened for it (this process is out of file
  descriptors or memory: :mod:`llmgw.fdpressure`, counted there): nothing was
  sent, and it says nothing about the upstream;
- ``tls``: the TLS handshake with an ``https://`` upstream failed (an untrusted
  certificate, a host name mismatch): like ``connect``, nothing was sent;
- ``closed_before_request``: the connection failed on the first write, before
  the upstream accepted any byte of the request;
- ``closed_after_request``: the upstream took (some of) the request, then
  closed or reset the connection without a response head;
- ``timeout``: no response head within ``first_byte_timeout``, or silence
  mid-body past ``idle_timeout``;
- ``protocol``: a malformed response;
- ``closed``: the connection dropped mid-body, after the head.

With an ``ssl.SSLContext`` (an ``https://`` replica) every new connection is a
:class:`~llmgw.http.tls_socket.TlsSocket` whose handshake completes, within
the connect timeout, before any request byte is written: a certificate the
context does not trust fails as ``kind="tls"`` naming the problem, like a
refused connection (retried on another replica, counted against health).

Like :mod:`llmgw.http.server`, the hot path uses plain non-blocking sockets
with ``trio.lowlevel.wait_readable`` and :mod:`llmgw.http.deadlines` watches
instead of ``trio.SocketStream`` and cancel scopes: a request whose head and
body fit in one ``send`` and whose answer arrives in one read costs one
``send``, one wait and one ``recv``.
"""

from __future__ import annotations

import errno
import socket
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable

import httptools
import trio

from ..fdpressure import capacity_errno, note_shortage
from ..tls import describe_tls_error
from .deadlines import Watch
from .tls_socket import Stream, TlsSocket, waiting_poller

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
    __slots__ = ("sock", "watch", "idle_since", "uses", "parser", "poller")

    def __init__(self, sock: Stream):
        self.sock = sock
        self.watch = Watch(sock, "upstream")
        self.idle_since = 0.0
        self.uses = 0
        self.parser: _ResponseParser | None = None  # kept while responses end cleanly
        self.poller = waiting_poller(sock)  # for still_open(): asked with a zero timeout

    def still_open(self) -> bool:
        """An idle connection has nothing to read: anything waiting (an end, a reset, stray bytes, TLS's
        close_notify) means the upstream closed it or died meanwhile, which must not pass for a close after our
        next request. One ``poll`` of the kernel socket with a zero timeout: what a ``recv(1, MSG_PEEK)`` would
        see, without the ``BlockingIOError`` a peek raises when nothing is there (a third of its cost)."""
        return self.sock.fileno() >= 0 and not self.poller.poll(0)

    def close(self) -> None:
        self.watch.disarm()
        sock = self.sock
        if sock.fileno() >= 0:
            trio.lowlevel.notify_closing(sock)
            sock.close()

    async def _wait(self, wait: Callable[[Stream], Awaitable[None]], timeout: float, timeout_message: str,
                    before_head: bool) -> None:
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
            except ssl.SSLError as tls_error:  # e.g. an mTLS upstream's alert that it wants our certificate
                raise UpstreamError("tls", describe_tls_error(tls_error), before_head=before_head) from None
            except OSError as exc:
                raise UpstreamError("closed", f"upstream connection broke: {exc}", before_head=before_head) from None

    async def send_all(self, data: bytes | memoryview, timeout: float, *, first: bool) -> None:
        """Send ``data``; ``first``: it starts the request (a failure before any byte went out says the
        connection was dead before the upstream could see anything of the request)."""
        sock = self.sock
        try:
            sent = sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise _send_error(exc, untouched=first) from None
        if sent == len(data):
            return
        view = memoryview(data)[sent:]
        untouched = first and sent == 0
        while view:
            await self._wait(trio.lowlevel.wait_writable, timeout,
                             f"upstream did not take the request within {timeout:g}s", before_head=True)
            try:
                sent = sock.send(view)
            except BlockingIOError:
                continue
            except OSError as exc:
                raise _send_error(exc, untouched=untouched) from None
            # (outside the try: mypyc 2.4 lost this assignment made inside it, after an await in the loop)
            view = view[sent:]
            untouched = False


def _send_error(exc: OSError, *, untouched: bool) -> UpstreamError:
    if untouched:
        return UpstreamError("closed_before_request", f"upstream connection was closed before it took any byte of "
                                                      f"the request: {exc}")
    return UpstreamError("closed_after_request", f"upstream connection broke while the request was being sent: {exc}")


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
        self._read_ahead: bytes | None = None  # the whole body, when read_ahead() took it
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

    async def read_ahead(self) -> None:
        """Read the whole body now, so that :meth:`read` returns it at once; ``UpstreamError`` when the upstream
        fails before it ends."""
        self._read_ahead = await self.read()

    async def read(self) -> bytes:
        """The whole body."""
        if self._read_ahead is not None:
            data, self._read_ahead = self._read_ahead, None
            return data
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
        except httptools.HttpParserError as malformed:
            raise UpstreamError("protocol", f"malformed upstream response: {malformed}", before_head=False) from None

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
    """Keep-alive connections to one upstream ``host:port``, over TLS when given an ``ssl.SSLContext``.

    ``server_hostname`` is the name the upstream's certificate must carry (default: ``host``).
    """

    def __init__(self, host: str, port: int, *, connect_timeout: float = 3.0, max_idle: int = 128,
                 idle_expiry: float = 4.0, tls: ssl.SSLContext | None = None, server_hostname: str | None = None):
        self.host = host
        self.port = port
        self.connect_timeout = connect_timeout
        self.tls = tls
        self.server_hostname = server_hostname or host
        self.max_idle = max_idle
        # Upstream servers close idle keep-alive connections (uvicorn after 5 s); reuse only fresher ones.
        self.idle_expiry = idle_expiry
        self._idle: deque[_Connection] = deque()
        self.open_connections = 0
        self.host_header = (host if ":" not in host else f"[{host}]").encode() + b":%d" % port

    async def request(self, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes, *,
                      first_byte_timeout: float, idle_timeout: float) -> UpstreamResponse:
        """Send a request and wait for the response head.

        An idle connection the upstream closed meanwhile is never used (see
        :meth:`_Connection.still_open`); a pooled connection that fails on the first
        write is retried once on a fresh one. A request the upstream took is
        never sent again: a close after it may be the request's own doing.
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
                self._explain(exc, reused)
                self._discard_now(conn)
                if reused and exc.kind == "closed_before_request" and attempt == 0:
                    continue
                raise
            except BaseException:
                self._discard_now(conn)
                raise
        raise AssertionError("unreachable")

    def _explain(self, exc: UpstreamError, reused: bool) -> None:
        """Add what a broken new TLS connection often means to its message.

        TLS 1.3 servers check a client certificate after our side of the handshake is done; many (uvicorn,
        hence vLLM) then drop the connection with our request unread, and their alert is lost in the reset.
        """
        if not reused and self.tls is not None and exc.kind.startswith("closed"):
            exc.args = (f"{exc} (on a new TLS connection; an upstream that requires a client certificate does "
                        "this when it gets none or refuses it: see tls_cert_file)",)

    async def _exchange(self, conn: _Connection, method: str, head: bytes, body: bytes,
                        first_byte_timeout: float, idle_timeout: float) -> UpstreamResponse:
        conn.uses += 1
        await conn.send_all(head, first_byte_timeout, first=True)
        if body:
            await conn.send_all(body, first_byte_timeout, first=False)
        parser = conn.parser
        if parser is None:
            parser = conn.parser = _ResponseParser()
        else:
            parser.reset()
        feed = parser.parser.feed_data
        message = f"no response head from upstream within {first_byte_timeout:g}s"
        while not parser.head_done:
            try:
                data = await conn.receive(first_byte_timeout, message, before_head=True)
            except UpstreamError as exc:
                if exc.kind == "closed":
                    raise UpstreamError("closed_after_request", f"after taking the request, {exc}") from None
                raise
            if not data:
                raise UpstreamError("closed_after_request", "upstream closed the connection after taking the "
                                                            "request, without answering")
            try:
                feed(data)
            except httptools.HttpParserError as malformed:
                raise UpstreamError("protocol", f"malformed upstream response: {malformed}") from None
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
                if now - conn.idle_since < self.idle_expiry and conn.still_open():
                    return conn
                self._discard_now(conn)
        with trio.move_on_after(self.connect_timeout):
            try:
                stream = await trio.open_tcp_stream(self.host, self.port)
            except OSError as exc:
                reason = errno.errorcode.get(exc.errno or 0, "") or str(exc)
                if capacity_errno(exc) is not None:
                    note_shortage("upstream_connect", exc, f"{self.host}:{self.port}")
                    raise UpstreamError("capacity", f"no socket for a connection to {self.host}:{self.port}: "
                                                    f"this process is out of file descriptors ({reason})") from None
                raise UpstreamError("connect", f"cannot connect to {self.host}:{self.port}: {reason}") from None
            # From here on a plain non-blocking socket (TCP_NODELAY was set by trio).
            plain = socket.socket(fileno=stream.socket.detach())
            plain.setblocking(False)
            sock: Stream = plain if self.tls is None else await self._handshake(plain, self.tls)
            self.open_connections += 1
            return _Connection(sock)
        raise UpstreamError("connect", f"connecting to {self.host}:{self.port} "
                                       f"{'with TLS ' if self.tls else ''}took longer than "
                                       f"{self.connect_timeout:g}s")

    async def _handshake(self, sock: socket.socket, tls: ssl.SSLContext) -> TlsSocket:
        """TLS before any request byte (the caller's connect deadline bounds it); the socket is closed on failure."""
        tls_sock = TlsSocket(sock, tls, server_side=False, server_hostname=self.server_hostname)
        try:
            await tls_sock.handshake()
        except BaseException as exc:
            trio.lowlevel.notify_closing(sock)
            sock.close()
            if isinstance(exc, ssl.SSLError):
                raise UpstreamError("tls", f"TLS handshake with {self.host}:{self.port} failed: "
                                           f"{describe_tls_error(exc)}") from None
            if isinstance(exc, OSError):
                raise UpstreamError("connect", f"connection to {self.host}:{self.port} broke during the TLS "
                                               f"handshake: {exc}") from None
            raise
        return tls_sock

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
