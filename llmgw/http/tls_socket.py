"""TLS over the plain non-blocking sockets of the thin HTTP layer: one adapter for the server and the client.

The data plane's server and upstream client drive non-blocking sockets with
``trio.lowlevel.wait_readable``/``wait_writable`` (see :mod:`llmgw.http.server`).
:class:`TlsSocket` gives them the same ``recv``/``send``/``sendmsg``/``fileno``
interface over an ``ssl.SSLObject`` and memory BIOs, so the hot path, its
deadline watches and its disconnect detection are the same code with and
without TLS.

What makes that sound:

* ``recv`` decrypts *everything* the bytes it took from the kernel hold before
  it returns. No plaintext is ever left inside the TLS object while the
  caller waits for the kernel socket to become readable (that would hang).
  What is left is at most a partial record, which needs more bytes anyway.
  It takes no more ciphertext than ``size`` so that, like a plain ``recv``,
  it returns at most ``size`` bytes. The handshake reads record by record
  for the same reason: what the peer sends right behind it stays in the
  kernel.
  It raises ``BlockingIOError`` when no application data is ready (also when
  the bytes read were only TLS housekeeping, such as session tickets), and
  returns ``b""`` at the peer's end (``close_notify`` or a TCP close without
  one, as HTTPS clients do: HTTP framing says whether a body was whole).
* ``send`` keeps the socket contract "the number of bytes taken; call again
  with the rest". Encrypted bytes the kernel did not take wait in a buffer;
  while they wait ``send`` raises ``BlockingIOError``. When a send's records
  could not all be written, it reports its last plaintext byte as not taken,
  so the caller waits for writability and calls again, which flushes the
  records and then counts that byte (it was encrypted already).
* :meth:`TlsSocket.handshake` runs before any application byte is sent, under
  the caller's deadline; certificate problems surface there as
  ``ssl.SSLCertVerificationError`` (see :func:`llmgw.tls.describe_tls_error`).
"""

from __future__ import annotations

import select
import socket
import ssl
from collections.abc import Iterable
from typing import Any

import trio

RAW_READ = 65536
_Bytes = bytes | bytearray | memoryview
_RECORD_TYPES = frozenset((20, 21, 22, 23, 24))  # change_cipher_spec, alert, handshake, application_data, heartbeat
MAX_RECORD = 16384 + 2048  # the largest record TLS allows (RFC 5246 6.2.3), header excluded
MAX_PLAINTEXT_PER_SEND = 262144  # bounds the encrypted bytes one send may queue


class TlsSocket:
    """A non-blocking socket's ``recv``/``send`` with TLS in between; wrap after connect or accept."""

    __slots__ = ("sock", "_tls", "_incoming", "_outgoing", "_pending", "_owed", "_eof")

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, *, server_side: bool,
                 server_hostname: str | None = None):
        self.sock = sock
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self._tls = context.wrap_bio(self._incoming, self._outgoing, server_side=server_side,
                                     server_hostname=server_hostname)
        self._pending = b""  # encrypted bytes the kernel has not taken yet
        self._owed = 0  # plaintext bytes already encrypted but reported as not sent (see the module docstring)
        self._eof = False

    # -- the socket interface the HTTP layer uses ------------------------------------------------------------------

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def shutdown(self, how: int) -> None:
        if how in (socket.SHUT_WR, socket.SHUT_RDWR):
            try:
                self._tls.unwrap()  # queues close_notify
            except ssl.SSLError:
                pass
            self._flush()
        self.sock.shutdown(how)

    def getpeercert(self) -> dict[str, Any] | None:
        return self._tls.getpeercert()

    def recv(self, size: int = RAW_READ, flags: int = 0) -> bytes:
        """Application bytes that arrived, at most ``size`` (at least 32 KiB: a record is up to 16 KiB);
        ``BlockingIOError`` when none are. With ``flags`` (``MSG_PEEK``): the kernel socket's own answer,
        which says whether anything, or the end, is waiting (nothing decrypted is ever held back)."""
        if flags:
            return self.sock.recv(size, flags)
        incoming = self._incoming
        want = size - incoming.pending  # so that what is decrypted fits in ``size`` like a plain recv
        if not self._eof and want > 0:
            try:
                raw = self.sock.recv(want)
            except BlockingIOError:
                raw = None
            if raw:
                incoming.write(raw)
            elif raw is not None:
                incoming.write_eof()
                self._eof = True
        parts = []
        ended = False
        read = self._tls.read
        while True:
            try:
                data = read(RAW_READ)
            except ssl.SSLWantReadError:
                break
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                ended = True
                break
            if not data:
                ended = True
                break
            parts.append(data)
        if self._outgoing.pending:  # an alert or a post-handshake message of ours
            try:
                self._flush()
            except OSError:
                pass  # the peer is gone: what it sent is still worth reading, and the next send says so
        if parts:
            return parts[0] if len(parts) == 1 else b"".join(parts)
        if ended or self._eof:
            return b""
        raise BlockingIOError(11, "no TLS application data yet")

    def send(self, data: _Bytes) -> int:
        """Encrypt and send from ``data``; the number of its bytes taken (``BlockingIOError``: none yet)."""
        if self._pending and not self._flush():
            raise BlockingIOError(11, "earlier TLS records are still waiting for the socket")
        owed = self._owed
        if owed:  # the caller sends again what we reported as not sent: it went out with the last records
            self._owed = 0
            if len(data) <= owed:
                return len(data)
            return owed + self._encrypt_and_send(memoryview(data)[owed:])
        return self._encrypt_and_send(data)

    def sendmsg(self, buffers: Iterable[_Bytes]) -> int:
        return self.send(b"".join(buffers))

    def _encrypt_and_send(self, data: _Bytes) -> int:
        if not data:
            return 0
        taken = min(len(data), MAX_PLAINTEXT_PER_SEND)
        self._tls.write(data[:taken] if taken < len(data) else data)
        if self._flush():
            return taken
        self._owed = 1
        return taken - 1

    def _flush(self) -> bool:
        """Hand encrypted bytes to the kernel; True when none are left waiting."""
        pending = self._pending + self._outgoing.read() if self._outgoing.pending else self._pending
        if not pending:
            return True
        try:
            sent = self.sock.send(pending)
        except BlockingIOError:
            sent = 0
        self._pending = pending[sent:]
        return not self._pending

    # -- the handshake -----------------------------------------------------------------------------------------------

    async def handshake(self) -> None:
        """Complete the TLS handshake; ``ssl.SSLError`` (a certificate problem, a plaintext peer) or ``OSError``.

        Run it under the caller's deadline (a cancel scope): a peer that stalls never completes it.
        """
        tls = self._tls
        while True:
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._drain_outgoing()
                await self._read_record()
            except ssl.SSLError:
                try:
                    self._flush()  # the alert that tells the peer why, if the kernel takes it at once
                except OSError:
                    pass
                raise
        await self._drain_outgoing()

    async def _drain_outgoing(self) -> None:
        while not self._flush():
            await trio.lowlevel.wait_writable(self.sock)

    async def _read_record(self) -> None:
        """Feed the TLS object one more record from the kernel, and not a byte past it.

        The handshake reads record by record so that whatever the peer sent behind its last handshake
        message (a request, pipelined at once) stays in the kernel, where ``wait_readable`` sees it.
        """
        header = await self._receive_exactly(5)
        length = int.from_bytes(header[3:5], "big")
        if len(header) == 5 and header[0] in _RECORD_TYPES and header[1] == 3 and length <= MAX_RECORD:
            header += await self._receive_exactly(length)
        # else not TLS (say, plain HTTP): OpenSSL names the problem at once from what is there
        self._incoming.write(header)
        if self._eof:
            self._incoming.write_eof()

    async def _receive_exactly(self, size: int) -> bytes:
        data = b""
        while len(data) < size and not self._eof:
            try:
                raw = self.sock.recv(size - len(data))
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
                continue
            if not raw:
                self._eof = True
            data += raw
        return data


Stream = socket.socket | TlsSocket  # a connection's socket, plain or with TLS: the HTTP layer uses either alike

_ANYTHING_WAITING = select.POLLIN | select.POLLPRI | select.POLLRDHUP  # (errors and hang-ups are always reported)


def waiting_poller(sock: Stream) -> select.poll:
    """A ``poll`` object registered once for ``sock``'s kernel socket: ``poll(0)`` on it tells whether anything waits
    to be read (bytes, an end, a reset; with TLS a record: no plaintext is ever left in a :class:`TlsSocket`),
    without the ``BlockingIOError`` a ``recv`` raises when nothing is there."""
    poller = select.poll()
    poller.register(sock.fileno(), _ANYTHING_WAITING)
    return poller
