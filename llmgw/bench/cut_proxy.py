"""A TCP proxy on loopback that the chaos benchmark can cut and restore: a partition between one process and a server.

:class:`CutProxy` listens on an ephemeral 127.0.0.1 port and relays each connection
to one upstream port. :meth:`~CutProxy.cut` stops every byte in both directions and
every new connection from reaching the upstream, without closing anything: the
bytes wait (as TCP retransmits them across a partition) and go through when
:meth:`~CutProxy.restore` is called. An upstream that closes (a server killed)
closes the client's side too, as a direct connection would show.
"""

from __future__ import annotations

import contextlib
import errno

import trio

CHUNK = 65536  # bytes read per step: a connection holds at most one chunk while cut
MAX_CONNECTIONS = 256  # more are closed at once (a Redis client of a gateway opens a few)
CONNECT_TIMEOUT = 5.0


class CutProxy:
    """``await nursery.start(proxy.run)``; then :attr:`port` relays to ``upstream_port`` until :meth:`cut`."""

    def __init__(self, upstream_port: int, *, max_connections: int = MAX_CONNECTIONS):
        self.upstream_port = upstream_port
        self.max_connections = max_connections
        self.port = 0
        self.connections = 0
        self.refused = 0  # connections closed at once: too many, or the upstream refused or timed out
        self.cuts = 0
        self._open = trio.Event()
        self._open.set()

    @property
    def is_cut(self) -> bool:
        return not self._open.is_set()

    def cut(self) -> None:
        if not self.is_cut:
            self.cuts += 1
            self._open = trio.Event()

    def restore(self) -> None:
        self._open.set()

    async def run(self, *, task_status: trio.TaskStatus[CutProxy] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self)
        await trio.serve_listeners(self._relay, listeners)

    async def _passable(self) -> None:
        """Until the proxy is not cut (at once when it is not)."""
        while not self._open.is_set():
            await self._open.wait()

    async def _relay(self, client: trio.SocketStream) -> None:
        async with client:
            if self.connections >= self.max_connections:
                self.refused += 1
                return
            self.connections += 1
            try:
                await self._passable()  # a connection opened during a cut reaches nothing until the restore
                try:
                    with trio.fail_after(CONNECT_TIMEOUT):
                        upstream = await trio.open_tcp_stream("127.0.0.1", self.upstream_port)
                except (OSError, trio.TooSlowError):
                    self.refused += 1
                    return
                async with upstream, trio.open_nursery() as nursery:
                    nursery.start_soon(self._pump, client, upstream, nursery.cancel_scope)
                    nursery.start_soon(self._pump, upstream, client, nursery.cancel_scope)
            finally:
                self.connections -= 1

    async def _pump(self, source: trio.SocketStream, target: trio.SocketStream, both: trio.CancelScope) -> None:
        # No deadline on the reads: an idle connection is a normal one (its two ends own their timeouts); the
        # relay ends when either side closes, and with the proxy's nursery.
        try:
            while data := await source.receive_some(CHUNK):
                await self._passable()
                await target.send_all(data)
        except trio.BrokenResourceError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.ECONNRESET, errno.EPIPE):
                raise
        finally:
            both.cancel()  # one side gone: close both, as the peer of a direct connection would see


@contextlib.asynccontextmanager
async def cut_proxy(upstream_port: int):
    """A running :class:`CutProxy` for the block (tests and small scripts)."""
    async with trio.open_nursery() as nursery:
        proxy = await nursery.start(CutProxy(upstream_port).run)
        try:
            yield proxy
        finally:
            nursery.cancel_scope.cancel()
